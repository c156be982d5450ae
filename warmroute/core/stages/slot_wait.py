"""Scorer: the seconds a request would wait in the router for a slot at an instance whose engine is full
(core/admission/capacity.py: as many requests in flight as it runs at once, beyond those already waiting for
it); 0 elsewhere. Added to the estimated time to first token, it weighs waiting for the engine that holds the
prefix against a full prefill on one with room: a request goes where it is answered soonest, and waits in the
router only where that is still the soonest.

When every candidate is full (the fleet saturated), a shorter line only moves the wait onto the requests behind,
while a prefix computed again elsewhere is compute the whole fleet lacks: there the uncached tokens of a prompt whose
prefix several instances hold, or none, weigh `saturated_miss_weight` instead of the prefix match's shared weight.
With `copy_only_hot` (off by default), so do those of a prompt whose prefix several instances hold while that prefix
is not hot (hot_share), full or not: the shared weight exists to copy a popular prefix to more instances, and one
more copy of a prefix that carries less than an instance's share of the requests spreads no load that needed
spreading. Not a prompt whose one holder is swamped (prefix_match's SWAMPED): that engine evicts it anyway."""

from __future__ import annotations

from collections.abc import Callable

from warmroute.core.fleet import Instance
from warmroute.core.pipeline import Request, Scorer
from warmroute.core.stages.prefix_match import SHARED


class SlotWait(Scorer):
    name = "slot_wait"

    def __init__(self, wait: Callable[[Instance], float], saturated_miss_weight: float = 16.0,
                 copy_only_hot: bool = False) -> None:
        self.wait = wait
        self.saturated_miss_weight = saturated_miss_weight
        self.copy_only_hot = copy_only_hot

    def score(self, req: Request, candidates: list[Instance]) -> list[float]:
        wait = self.wait
        waits = [wait(i) for i in candidates]
        extra = self.saturated_miss_weight - req.alpha
        # (req.miss is alpha x the uncached tokens: with a shared weight of 0 it says nothing to weigh again)
        if req.holder != SHARED or extra <= 0 or req.alpha <= 0:
            return waits
        saturated = min(waits) > 0  # no candidate has room
        # (a SHARED prompt with holders has several: prefix_match calls a single holder's PRIVATE or SWAMPED)
        needless_copy = self.copy_only_hot and bool(req.depths) and not req.hot
        if not (saturated or needless_copy):
            return waits
        get, miss_all, per_token = req.miss.get, req.miss_all, extra / req.alpha
        return [w + per_token * get(i.name, miss_all) / i.prefill_tokens_per_s for w, i in zip(waits, candidates)]
