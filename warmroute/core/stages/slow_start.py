"""Filter: slow start. An instance that has just joined (or come back healthy) takes traffic gradually, as Envoy's
slow_start does: over `window` seconds its share of the recent requests may grow to a full one along
core/slow_start.py's weight, max(min_weight, (elapsed / window) ** (1 / aggression)), so it neither sits idle
nor drowns in the cold prefills a cost model sends to an empty cache with an empty queue. It is skipped once it was sent more than weight × the mean of the routable instances' recent requests;
and while it is under that and has no prefill queued, a hot prefix's requests go to it first, so the prefixes
most worth holding are copied there before anything else, one at a time (the rest of each prompt is a cold
prefill there too: forced on it whatever its queue, they drown it just when the fleet scaled out to catch up).
The ramp applies only while some routable instance is not ramping (a fleet that starts cold has nothing to ramp
against).
"""

from __future__ import annotations

from warmroute.core.decision import SLOW_START
from warmroute.core.fleet import Instance
from warmroute.core.pipeline import Filter, Request
from warmroute.core.slow_start import slow_start_weight


class SlowStart(Filter):
    name = "slow_start"

    def __init__(self, window: float, aggression: float, min_weight: float) -> None:
        self.window, self.aggression, self.min_weight = window, aggression, min_weight

    def prepare(self, req: Request) -> None:
        """The cap on recent requests of each ramping routable instance (req.ramp_caps; empty, as almost always:
        none is ramping)."""
        if not req.fleet.ramps:
            return
        elapsed = req.fleet.ramping(self.window)
        up = req.up
        ramping = [i for i in up if i.name in elapsed]
        if not ramping or len(ramping) == len(up):
            return
        mean = sum([i.recent for i in up]) / len(up)
        req.ramp_caps = {i.name: mean * slow_start_weight(elapsed[i.name], self.window, self.aggression,
                                                          self.min_weight) for i in ramping}

    def filter(self, req: Request, candidates: list[Instance]) -> list[Instance]:
        caps = req.ramp_caps
        if not caps:
            return candidates
        kept = [i for i in candidates if i.name not in caps or i.recent <= caps[i.name]]
        if req.hot:  # a hot prefix: copied first to the warming instances that still have room and no queue
            warming = [i for i in kept if i.name in caps and not i.queued_prefill_tokens]
            kept = warming or kept
        return kept or candidates

    def explain(self, req: Request, chosen: Instance) -> str | None:
        caps = req.ramp_caps
        if not caps:
            return None
        if req.hot and chosen.name in caps:
            return SLOW_START
        holders = [n for n, d in req.depths.items() if d == req.deepest and n in caps]
        if any(i.recent > caps[i.name] for i in req.up if i.name in holders):
            return SLOW_START  # its holder is warming and had had its share
        return None
