"""Picker steps by load: among tied candidates keep those within a slack of the least loaded (so a cold prefix
leaves warm instances' headroom for their own prefixes); or, as the last picker, the least loaded one."""

from __future__ import annotations

from warmroute.core.decision import LOAD_BALANCE
from warmroute.core.fleet import Instance
from warmroute.core.pipeline import Picker, Request
from warmroute.core.stages.load_guard import least_loaded


class LeastLoadedTies(Picker):
    name = "least_loaded_ties"

    def __init__(self, slack: int) -> None:
        self.slack = slack  # requests in flight

    def narrow(self, req: Request, candidates: list[Instance], costs: list[float] | None
               ) -> tuple[list[Instance], list[float] | None]:
        least = min([i.inflight for i in candidates])
        kept = [k for k, i in enumerate(candidates) if i.inflight <= least + self.slack]
        return [candidates[k] for k in kept], None if costs is None else [costs[k] for k in kept]


class LeastLoaded(Picker):
    name = "least_loaded"

    def pick(self, req: Request, candidates: list[Instance]) -> Instance:
        return least_loaded(candidates)

    def explain(self, req: Request, chosen: Instance) -> str | None:
        return LOAD_BALANCE
