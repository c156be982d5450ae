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

    __slots__ = ("_by_instance",)

    def __init__(self) -> None:
        self._by_instance: dict[str, dict[int, Computing]] = {}

    def leader(self, leg: Computing, depth: int) -> Computing | None:
        """Another leg still computing the block after the `depth` blocks of `leg`'s chain its instance is predicted
        to hold (a chain recorded a moment after this prediction), or the deepest of those; None if both are
        computed."""
        computing = self._by_instance.get(leg.instance)
        blocks = leg.blocks
        if not computing or not blocks:
            return None
        for i in (depth, depth - 1):
            if 0 <= i < len(blocks):
                other = computing.get(blocks[i])
                if other is not None and other is not leg and not _over(other):
                    return other
        return None

    def started(self, leg: Computing, depth: int) -> None:
        """`leg` was sent to compute its chain beyond the `depth` blocks its instance was predicted to hold."""
        if not leg.blocks or _over(leg):
            return
        computing = self._by_instance.setdefault(leg.instance, {})
        for block in leg.blocks[depth:]:
            held = computing.get(block)
            if held is None or _over(held):
                computing[block] = leg

    def ended(self, leg: Computing, depth: int) -> None:
        """`leg` is over at its instance: its entries go (those another leg took over stay)."""
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
        self._by_instance.pop(instance, None)

    def computing(self, instance: str) -> int:
        """Blocks `instance` is computing now for requests without a first token."""
        return sum(1 for leg in self._by_instance.get(instance, {}).values() if not _over(leg))

    def __len__(self) -> int:
        """Entries kept, those of legs past their first token included (each goes when its leg ends)."""
        return sum(map(len, self._by_instance.values()))
