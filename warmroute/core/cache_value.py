"""What each instance's cache is worth to the fleet: the cached work only it holds, weighted by demand.

Losing an instance costs the fleet only the prefixes no other instance holds as deeply: for each recently
requested chain of blocks, the instance holding it deepest loses (its depth - the next-deepest holder's depth)
blocks of cached prefill if it goes; every other instance loses nothing for that chain. Each chain counts by its
share of the recent requests (fading over a window of requests, core/fading.py), so a hot system prompt held by
one instance outweighs a long document asked for once. A conversation's earlier turns are chains too, fading
as it moves on.

`CacheValue` keeps the recent chains (bounded) and asks the prefix index who holds them; `unique_tokens`,
`scale_in_victim` and `deletion_costs` are pure functions of plain values. The victim is the instance whose
loss costs least; Kubernetes' `controller.kubernetes.io/pod-deletion-cost` annotation (an int32, higher = keep)
carries the same order to a ReplicaSet scaling down.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from warmroute.core.fading import FadingUnit

DELETION_COST_MAX = 2**31 - 1  # the annotation is an int32
DELETION_COST_SCALE = 1000  # per token of expected prefill saved per request, so fractions still order pods


class HoldsBlocks(Protocol):
    def match_depths(self, blocks: Sequence[int]) -> dict[str, int]: ...


def unique_tokens(depths: Mapping[str, int], block_tokens: int) -> dict[str, int]:
    """Per instance, the tokens of this chain it holds beyond every other instance (zero for all but the deepest
    holder, and for it too when another holds the chain as deeply)."""
    if not depths:
        return {}
    ranked = sorted(depths.values(), reverse=True)
    deepest, second = ranked[0], (ranked[1] if len(ranked) > 1 else 0)
    return {name: (d - second) * block_tokens if d == deepest and d > second else 0 for name, d in depths.items()}


class CacheValue:
    """The recently requested chains, each with its fading share of the requests."""

    def __init__(self, max_chains: int = 512, window: float = 512.0) -> None:
        self.max_chains = max_chains
        self.window = window  # requests over which a chain's weight fades by 1/e
        # last block -> (chain, weight); the chain is the request's own (read-only, never copied: a 2,000-block
        # prompt's copy cost ~100 µs on the request path)
        self._chains: dict[int, tuple[Sequence[int], float]] = {}
        self._unit = FadingUnit()
        self._total = 0.0

    def requested(self, blocks: Sequence[int]) -> None:
        """A request with this chain of blocks was routed (any instance)."""
        unit = self._unit.value
        self._total += unit
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
            self._total /= factor

    def values(self, index: HoldsBlocks, instances: Iterable[str], block_tokens: int) -> dict[str, float]:
        """Per instance, the prefill tokens per request (averaged over the recent requests) that would be
        recomputed if it went: sum over chains of share x the tokens only it holds."""
        out = {name: 0.0 for name in instances}
        if not self._total:
            return out
        for chain, weight in self._chains.values():
            share = weight / self._total
            for name, tokens in unique_tokens(index.match_depths(chain), block_tokens).items():
                if tokens and name in out:
                    out[name] += share * tokens
        return out

    def __len__(self) -> int:
        return len(self._chains)


def scale_in_victim(values: Mapping[str, float]) -> str | None:
    """The instance whose loss costs least (ties: the last name, so the choice is deterministic)."""
    if not values:
        return None
    return min(sorted(values, reverse=True), key=lambda name: values[name])


def deletion_costs(values: Mapping[str, float]) -> dict[str, int]:
    """`controller.kubernetes.io/pod-deletion-cost` per instance: its value as an int32, higher = keep."""
    return {name: min(DELETION_COST_MAX, max(0, round(v * DELETION_COST_SCALE))) for name, v in values.items()}
