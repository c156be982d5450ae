"""The prefixes each instance is computing right now, so that a request sharing one can wait for it.

An engine reuses a block of KV cache only once it has been computed (vLLM, SGLang and the emulated engine alike):
a request that reaches an instance while another request there is still computing the prefix they share computes
it a second time, and both wait for the same prefill twice over. The rule the lifecycle applies
(core/lifecycle.py, `Lifecycle.prefill_leader`): a request whose deepest predicted-cached block, or the block
after it, is still being computed at its instance by a request that has not had its first token waits for that
first token (or that request's end), then goes and finds the prefix cached. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Computing(Protocol):
    """What this module needs of a leg (core/lifecycle.py's Leg): its instance and chain."""

    instance: str
    blocks: Sequence[int] | None


def _common(a: Sequence[int], b: Sequence[int], known: int) -> int:
    """How many leading blocks two chains share, given that they share at least `known`: a chained block hash
    stands for its whole prefix, so the chains agree up to some position and differ from there on (a binary search)."""
    lo, hi = known, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Prefills:
    """Per instance, the legs without a first token there and where in its chain each began computing. A leg is
    one entry whatever its prompt's length; it leaves at its first token or end."""

    __slots__ = ("_by_instance",)

    def __init__(self) -> None:
        self._by_instance: dict[str, dict[Computing, int]] = {}

    def leader(self, leg: Computing, depth: int) -> Computing | None:
        """The oldest other leg still computing the block after the `depth` blocks of `leg`'s chain its instance is
        predicted to hold (a chain recorded a moment after this prediction), or else the deepest of those, provided
        `leg` shares at least half of what that one computes; None otherwise. A leg that would reuse only a short
        system prompt of another's long prefill does not wait for all of it: the engine computes a prompt in order,
        so that short part is cached long before the other's first token."""
        computing = self._by_instance.get(leg.instance)
        blocks = leg.blocks
        if not computing or not blocks:
            return None
        for i in (depth, depth - 1):
            if not 0 <= i < len(blocks):
                continue
            block = blocks[i]
            for other, start in computing.items():  # oldest first
                theirs = other.blocks
                assert theirs is not None
                if other is not leg and start <= i < len(theirs) and theirs[i] == block:
                    shared = _common(blocks, theirs, i + 1)
                    return other if 2 * (shared - start) >= len(theirs) - start else None
        return None

    def started(self, leg: Computing, depth: int) -> None:
        """`leg` was sent to compute its chain beyond the `depth` blocks its instance was predicted to hold."""
        if leg.blocks and depth < len(leg.blocks):
            self._by_instance.setdefault(leg.instance, {})[leg] = depth

    def ended(self, leg: Computing) -> None:
        """`leg`'s prefill is over at its instance (its first token), or the leg itself is (it ended before one)."""
        computing = self._by_instance.get(leg.instance)
        if computing is not None and computing.pop(leg, None) is not None and not computing:
            del self._by_instance[leg.instance]

    def forget(self, instance: str) -> None:
        """The instance left the fleet."""
        self._by_instance.pop(instance, None)

    def computing(self, instance: str) -> int:
        """Blocks `instance` is computing now for requests without a first token."""
        return sum(len(leg.blocks or ()) - start for leg, start in self._by_instance.get(instance, {}).items())

    def __len__(self) -> int:
        """Legs kept, over all instances."""
        return sum(map(len, self._by_instance.values()))
