"""Which prefixes carry a large share of the recent requests (a hot system prompt), for cache_aware's guard; and
which tenants ask for more than their share of them, for the admission queue (any hashable key works).

Counts fade exponentially over a window of requests (core/fading.py). Memory is bounded: past `max_keys`
prefixes, those worth less than a few requests are dropped (a prefix that matters is worth many).
"""

from __future__ import annotations

from collections.abc import Hashable

from warmroute.core.fading import FadingUnit


class Popularity:
    def __init__(self, max_keys: int = 4096) -> None:
        self.max_keys = max_keys
        self._counts: dict[Hashable, float] = {}
        self._unit = FadingUnit()
        self._total = 0.0  # every request counted, with or without a prefix

    def share(self, prefix: Hashable) -> float:
        """The prefix's share of the recent requests, 0..1."""
        return self._counts.get(prefix, 0.0) / self._total if self._total else 0.0

    def add(self, prefix: Hashable | None, window: float) -> float:
        """One request, for this prefix (None: a request with none worth counting). Returns the prefix's share
        before it, as `share` gave it (0.0 for None): the guard asks both on every decision."""
        unit, total = self._unit.value, self._total
        self._total = total + unit
        before = 0.0
        if prefix is not None:
            counts = self._counts
            count = counts.get(prefix, 0.0)
            before = count / total if total else 0.0
            counts[prefix] = count + unit
            if len(counts) > self.max_keys:
                self._counts = {k: v for k, v in counts.items() if v > 4 * unit}
        factor = self._unit.advance(window)
        if factor is not None:
            self._counts = {k: v / factor for k, v in self._counts.items()}
            self._total /= factor
        return before

    def __len__(self) -> int:
        return len(self._counts)
