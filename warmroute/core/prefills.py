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
    """What this module needs of a leg (core/lifecycle.py's Leg): its instance and chain, and whether its
    prefill is over."""

    instance: str
    blocks: Sequence[int] | None
    got_first: bool
    done: bool


def _over(leg: Computing) -> bool:
    return leg.got_first or leg.done


class Prefills:
    """Block -> the leg computing it, per instance. A leg's entries stay until it ends; they count only until
    its first token (`_over`), and a later leg computing the same block again takes them over."""

    __slots__ = ("_by_instance", "_from")

    def __init__(self) -> None:
        self._by_instance: dict[str, dict[int, Computing]] = {}
        self._from: dict[Computing, int] = {}  # where each leg's computed blocks begin in its chain

    def leader(self, leg: Computing, depth: int) -> Computing | None:
        """Another leg still computing the block after the `depth` blocks of `leg`'s chain its instance is predicted
        to hold (a chain recorded a moment after this prediction), or else the deepest of those, provided `leg`
        shares at least half of what that one computes; None otherwise. A leg that would reuse only a short system
        prompt of another's long prefill does not wait for all of it: the engine computes a prompt in order, so that
        short part is cached long before the other's first token."""
        computing = self._by_instance.get(leg.instance)
        blocks = leg.blocks
        if not computing or not blocks:
            return None
        for i in (depth, depth - 1):
            if 0 <= i < len(blocks):
                other = computing.get(blocks[i])
                if other is not None and other is not leg and not _over(other):
                    return other if self._shares_most(other, blocks, i, computing) else None
        return None

    def _shares_most(self, other: Computing, blocks: Sequence[int], i: int, computing: dict[int, Computing]) -> bool:
        end = i + 1
        while end < len(blocks) and computing.get(blocks[end]) is other:
            end += 1
        start = self._from.get(other, 0)
        assert other.blocks is not None
        return 2 * (end - start) >= len(other.blocks) - start

    def started(self, leg: Computing, depth: int) -> None:
        """`leg` was sent to compute its chain beyond the `depth` blocks its instance was predicted to hold."""
        if not leg.blocks or _over(leg):
            return
        computing = self._by_instance.setdefault(leg.instance, {})
        self._from[leg] = depth
        for block in leg.blocks[depth:]:
            held = computing.get(block)
            if held is None or _over(held):
                computing[block] = leg

    def ended(self, leg: Computing, depth: int) -> None:
        """`leg` is over at its instance: its entries go (those another leg took over stay)."""
        self._from.pop(leg, None)
        computing = self._by_instance.get(leg.instance)
        if not computing or not leg.blocks:
            return
        for block in leg.blocks[depth:]:
            if computing.get(block) is leg:
                del computing[block]
        if not computing:
            del self._by_instance[leg.instance]

    def forget(self, instance: str) -> None:
        """The instance left the fleet."""
        if self._by_instance.pop(instance, None) is not None:
            self._from = {leg: at for leg, at in self._from.items() if leg.instance != instance}

    def computing(self, instance: str) -> int:
        """Blocks `instance` is computing now for requests without a first token."""
        return sum(1 for leg in self._by_instance.get(instance, {}).values() if not _over(leg))

    def __len__(self) -> int:
        """Entries kept, blocks and legs, those of legs past their first token included (each goes when its leg
        ends)."""
        return sum(map(len, self._by_instance.values())) + len(self._from)
