"""Several tenants at once: each its own workload and Poisson rate of requests, every request marked with its
tenant (the router's fair shares), the sessions of all in arrival order. For the noisy-tenant runs of the
simulator (benchmarks/overload.py sim-tenants); the HTTP driver offers the same streams in real time."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from warmroute.workloads.base import Workload
from warmroute.workloads.request import Session
from warmroute.workloads.text import rng_for


@dataclass(frozen=True)
class TenantStream:
    tenant: str
    workload: Workload
    rate: float  # requests per second (sessions arrive at rate / the workload's turns per session)
    start_s: float = 0.0  # its first session arrives this long after the run starts (a tenant joining a warm fleet)


def tagged(sessions: Iterator[Session], tenant: str) -> Iterator[Session]:
    """The sessions with each request marked as `tenant`'s."""
    for s in sessions:
        yield dataclasses.replace(s, requests=tuple(dataclasses.replace(r, tenant=tenant) for r in s.requests))


def turns_per_session(workload: Workload, sample: int = 2000) -> float:
    """Mean requests per session: the workload's own figure, else from its first `sample` sessions."""
    mean = getattr(workload, "mean_requests_per_session", None)
    if mean is not None:
        return float(mean())
    sessions = workload.sessions()
    return sum(len(next(sessions).requests) for _ in range(sample)) / sample


@dataclass
class Tenants(Workload):
    name: ClassVar[str] = "tenants"
    streams: tuple[TenantStream, ...] = field(default_factory=tuple)
    duration_s: float = 60.0  # sessions start within this many seconds

    def validate(self) -> None:
        if not self.streams or any(s.rate <= 0 or s.start_s < 0 for s in self.streams):
            raise ValueError("streams must be non-empty, each with a rate > 0 and a start >= 0")

    def sessions(self) -> Iterator[Session]:
        return heapq.merge(*(self._arrivals(s) for s in self.streams), key=lambda s: s.arrival_s or 0.0)

    def _arrivals(self, stream: TenantStream) -> Iterator[Session]:
        """One tenant's sessions, each starting at its Poisson arrival time (its later turns follow their turn)."""
        rng = rng_for(self.seed, self.name, stream.tenant)
        session_rate = stream.rate / turns_per_session(stream.workload)
        t = stream.start_s + rng.expovariate(session_rate)
        for s in tagged(stream.workload.sessions(), stream.tenant):
            if t >= self.duration_s:
                return
            first = dataclasses.replace(s.requests[0], arrival_s=t)
            yield dataclasses.replace(s, requests=(first, *s.requests[1:]))
            t += rng.expovariate(session_rate)

    def mean_requests_per_session(self) -> float:
        sessions = sum(s.rate / turns_per_session(s.workload) for s in self.streams)
        return sum(s.rate for s in self.streams) / sessions

    def working_set_tokens(self, concurrency: int = 1) -> int:
        per = max(1, concurrency // len(self.streams))
        return sum(s.workload.working_set_tokens(per) for s in self.streams)
