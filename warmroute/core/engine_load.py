"""The load an engine reports itself (its /metrics), folded into the routing cost beside the router's own books.

The router's books (in-flight requests, queued prefill tokens) hold only the requests this router sent. The
engine's counts also hold those of other router replicas and of clients that bypass the router; what exceeds
the router's books is *foreign* load. It is measured once per scrape against the books at that moment, so it
never counts this router's own requests twice, and the cost then adds it to the live books:
  * foreign requests (waiting + running) count as in flight for the bounded-load guard;
  * foreign waiting requests queue prefill ahead of a new request: each is charged the router's mean
    uncached prompt (their real size is unknown);
  * KV usage: the part of a new prompt that does not fit in the engine's free KV blocks waits for running
    requests to finish, so it is charged as queued work too.
With no scrape (or a failed one) all three are zero and routing is exactly as without engine signals.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    waiting: int | None = None  # requests the engine has queued
    running: int | None = None  # requests in its running batch
    kv_usage: float | None = None  # share of its KV blocks held by running requests, 0..1
    foreign_requests: float = 0.0  # waiting + running beyond this router's in-flight requests, at scrape time
    foreign_waiting: float = 0.0  # waiting beyond this router's requests that had no first token yet


def observe(waiting: int | None, running: int | None, kv_usage: float | None, own_inflight: int,
            own_pending: int) -> EngineLoad:
    """A scrape's figures against the router's books at the same moment (`own_pending`: no first token yet)."""
    total = (waiting or 0) + (running or 0)
    foreign = max(0, total - own_inflight) if waiting is not None or running is not None else 0
    foreign_waiting = max(0, waiting - own_pending) if waiting is not None else 0
    usage = min(1.0, max(0.0, kv_usage)) if kv_usage is not None else None
    return EngineLoad(waiting, running, usage, float(foreign), float(min(foreign, foreign_waiting)))


def backlog_tokens(load: EngineLoad | None, prompt_tokens: int, capacity_tokens: int,
                   mean_request_tokens: float) -> float:
    """Prefill-token equivalent of the work the engine reports beyond the router's books."""
    if load is None:
        return 0.0
    extra = load.foreign_waiting * mean_request_tokens
    if load.kv_usage is not None:
        extra += max(0.0, prompt_tokens - (1.0 - load.kv_usage) * capacity_tokens)
    return extra


def foreign_requests(load: EngineLoad | None) -> float:
    return load.foreign_requests if load is not None else 0.0
