"""Scorer: the seconds a request would wait in the router for a slot at an instance whose engine is full
(core/admission/capacity.py: as many requests in flight as it runs at once, beyond those already waiting for
it); 0 elsewhere. Added to the estimated time to first token, it weighs waiting for the engine that holds the
prefix against a full prefill on one with room: a request goes where it is answered soonest, and waits in the
router only where that is still the soonest."""

from __future__ import annotations

from collections.abc import Callable

from warmroute.core.fleet import Instance
from warmroute.core.pipeline import Request, Scorer


class SlotWait(Scorer):
    name = "slot_wait"

    def __init__(self, wait: Callable[[Instance], float]) -> None:
        self.wait = wait

    def score(self, req: Request, candidates: list[Instance]) -> list[float]:
        wait = self.wait
        return [wait(i) for i in candidates]
