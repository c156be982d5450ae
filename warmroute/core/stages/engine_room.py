"""Filter: no instance whose engine is full (as many requests in flight as it runs at once: core/admission.py)
while another has room. The request then goes to the instance with room that the later stages rank first (an
overload spill: it may miss the cache, no engine queues it). When every engine is full, all stay: the cost chooses,
and the admission queue holds the request for that instance."""

from __future__ import annotations

from collections.abc import Callable

from warmroute.core.fleet import Instance
from warmroute.core.pipeline import Filter, Request


class EngineRoom(Filter):
    name = "engine_room"

    def __init__(self, full: Callable[[Instance], bool]) -> None:
        self.full = full

    def filter(self, req: Request, candidates: list[Instance]) -> list[Instance]:
        full = self.full
        kept = [i for i in candidates if not full(i)]
        return kept or candidates
