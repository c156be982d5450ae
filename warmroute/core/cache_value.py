"""What each instance's cache is worth to the fleet: the cached work only it holds that will be asked for again.

Losing an instance costs the fleet only the prefixes no other instance holds as deeply: for each recently
requested chain of blocks, the instance holding it deepest holds (its depth - the next-deepest holder's depth)
blocks that would have to be prefilled again elsewhere if it went; every other instance loses nothing for that
chain. A block lost is recomputed once, by the first request that needs it after the loss, and is then cached
where that request went: so each block counts once however many requests use it, times the chance that one
does within the window (1 - e^-n, n its fading count of recent requests: a hot system prompt counts as fully
as it is long, not as many times as it is asked for; a document asked for once counts about two thirds). The
value is the prefill tokens the fleet would expect to recompute over the next window of requests. A
conversation's earlier turns are chains too, fading as it moves on.

`CacheValue` keeps the recent chains (bounded) and asks the prefix index who holds them; `sole_lead`,
`scale_in_victim` and `deletion_costs` are pure functions of plain values. The victim is the
instance whose loss costs least; Kubernetes' `controller.kubernetes.io/pod-deletion-cost` annotation (an int32,
higher = keep) carries the same order to a ReplicaSet scaling down.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from warmroute.core.fading import FadingUnit

DELETION_COST_MAX = 2**31 - 1  # the annotation is an int32


class HoldsBlocks(Protocol):
    def match_depths(self, blocks: Sequence[int]) -> dict[str, int]: ...


def sole_lead(depths: Mapping[str, int]) -> tuple[str, int, int] | None:
    """The instance holding a chain deeper than any other, and the blocks [from, to) only it holds (None: no
    instance holds it, or two hold it as deeply)."""
    if not depths:
        return None
    ranked = sorted(depths.items(), key=lambda kv: kv[1], reverse=True)
    (owner, deepest), second = ranked[0], (ranked[1][1] if len(ranked) > 1 else 0)
    return (owner, second, deepest) if deepest > second else None


class CacheValue:
    """The recently requested chains, each with its fading share of the requests."""

    def __init__(self, max_chains: int = 512, window: float = 512.0) -> None:
        self.max_chains = max_chains
        self.window = window  # requests over which a chain's weight fades by 1/e
        # last block -> (chain, weight); the chain is the request's own (read-only, never copied: a long prompt's
        # copy would be paid on the request path; docs/tuning.md)
        self._chains: dict[int, tuple[Sequence[int], float]] = {}
        self._unit = FadingUnit()

    def requested(self, blocks: Sequence[int]) -> None:
        """A request with this chain of blocks was routed (any instance)."""
        unit = self._unit.value
        if blocks:
            key = blocks[-1]
            known = self._chains.get(key)
            self._chains[key] = (known[0] if known else blocks, (known[1] if known else 0.0) + unit)
            if len(self._chains) > self.max_chains:  # keep the heavier half: the rest is worth little now
                kept = sorted(self._chains.items(), key=lambda kv: kv[1][1], reverse=True)[: self.max_chains // 2]
                self._chains = dict(kept)
        factor = self._unit.advance(self.window)
        if factor is not None:
            self._chains = {k: (c, w / factor) for k, (c, w) in self._chains.items()}

    def values(self, index: HoldsBlocks, instances: Iterable[str], block_tokens: int) -> dict[str, float]:
        """Per instance, the prefill tokens the fleet would expect to recompute over the next window of requests if
        it went: each block of the recent chains that it alone holds, once, times the chance it is asked for."""
        alone: dict[str, dict[int, float]] = {name: {} for name in instances}
        unit = self._unit.value
        for chain, weight in self._chains.values():
            lead = sole_lead(index.match_depths(chain))
            if lead is None or lead[0] not in alone:
                continue
            owner, start, end = lead
            counts, n = alone[owner], weight / unit
            for block in chain[start:end]:
                counts[block] = counts.get(block, 0.0) + n
        return {name: block_tokens * sum(-math.expm1(-n) for n in counts.values()) for name, counts in alone.items()}

    def __len__(self) -> int:
        return len(self._chains)


def scale_in_victim(values: Mapping[str, float]) -> str | None:
    """The instance whose loss costs least (ties: the last name, so the choice is deterministic)."""
    if not values:
        return None
    return min(sorted(values, reverse=True), key=lambda name: values[name])


def deletion_costs(values: Mapping[str, float]) -> dict[str, int]:
    """`controller.kubernetes.io/pod-deletion-cost` per instance: its value in tokens, as an int32, higher = keep."""
    return {name: min(DELETION_COST_MAX, max(0, round(v))) for name, v in values.items()}
