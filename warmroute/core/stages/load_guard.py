"""Filter: the bounded-load guard. No instance at or above min(ConcurrencyThreshold, ⌈(1+ε) × (total + 1) / N⌉ +
slack) requests in flight, counting other routers' requests where the engine reports them. The cost already
steers away from queues; the guard only stops pile-ups. When every instance is at the guard: without an admission
queue, the least loaded takes the request (the reference router's spill); with one (`queue_behind`), the guard
keeps them all, the cost chooses, and the queue holds the request if that engine is full."""

from __future__ import annotations

import math

from warmroute.core.decision import OVERLOAD_SPILL
from warmroute.core.engine_load import foreign_requests
from warmroute.core.fleet import Instance
from warmroute.core.pipeline import Filter, Request


def least_loaded(instances: list[Instance]) -> Instance:
    return min(instances, key=lambda i: (i.inflight, i.queued_prefill_tokens, i.name))


def guard_loads(instances: list[Instance]) -> list[float]:
    """In-flight requests per instance as the guard counts them: other routers' too, where the engine says."""
    return [i.inflight if i.engine is None else i.inflight + foreign_requests(i.engine) for i in instances]


class LoadGuard(Filter):
    name = "load_guard"

    def __init__(self, threshold: int, factor: float, slack: int, queue_behind: bool = False) -> None:
        self.threshold, self.factor, self.slack, self.queue_behind = threshold, factor, slack, queue_behind

    def cap(self, loads: list[float]) -> float:
        return min(self.threshold, math.ceil((1 + self.factor) * (sum(loads) + 1) / len(loads)) + self.slack)

    def filter(self, req: Request, candidates: list[Instance]) -> list[Instance]:
        loads = guard_loads(candidates)
        cap = self.cap(loads)
        if max(loads) < cap:  # the usual case, no copy (a non-NaN max under the cap bounds every load)
            return candidates
        kept = [i for i, n in zip(candidates, loads) if not n >= cap]
        return kept if kept or not self.queue_behind else candidates

    def when_empty(self, req: Request) -> tuple[Instance, str]:
        return least_loaded(req.up), OVERLOAD_SPILL  # everyone is at the guard: least loaded, whatever it holds
