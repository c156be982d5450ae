"""What waits in the router's queue: one Waiter per request held back, and the reasons a request waits
(WAIT_REASONS, the admissions metric's labels) or is refused (SHED_REASONS, the sheds metric's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Why a waiting request was refused (the label values of the sheds metric).
QUEUE_FULL = "queue_full"  # the queue's bounds were reached, by requests of no lower priority
PREEMPTED = "preempted"  # removed from a full queue to make room for a higher-priority request
DEADLINE = "deadline"  # it waited its whole queue_timeout
NO_INSTANCE = "no_instance"  # no healthy instance may serve it any more (503)
SHED_REASONS = (QUEUE_FULL, PREEMPTED, DEADLINE, NO_INSTANCE)
# Why a request waited (Waiter.why; the label values of the admissions metric besides IMMEDIATE).
IMMEDIATE = "immediate"
BUSY = "engine_full"  # its instance's engine was full (as many in flight as it runs at once)
KV = "kv"  # its instance's KV demand was over hold_kv_limit with it (a conversation: the former hold)
SHARE = "share"  # its tenant had its share of its instance's queue (tenant_queue_share) while others were active
PREFILL = "prefill"  # its instance had its prefill_budget awaiting first tokens while several tenants were active
WAIT_REASONS = (BUSY, KV, SHARE, PREFILL)


@dataclass(slots=True, eq=False)
class Waiter:
    """One request waiting in the router. `depths`: matched tokens predicted per instance when it arrived."""

    seq: int
    priority: int
    tenant: str
    size_bytes: int
    enqueued: float
    deadline: float
    kv_tokens: int
    uncached_tokens: int = 0  # prefill it brings its pinned instance: counted there while it waits
    prompt_tokens: int = 0
    why: str = BUSY
    pin: str | None = None
    first: str | None = None  # the instance the strategy chose when it arrived (pinned or not)
    keep_until: float = 0.0  # until then only `pin` may take it; then others, once aging outweighs its loss there
    strict_until: float = 0.0  # until then the KV limit applies to it, and `pin` (if any) is preferred
    depths: dict[str, int] = field(default_factory=dict)
    blocks: Sequence[int] = ()  # its prompt's chain (the strategy's)
    model: str | None = None
    pool: str = ""  # in a disaggregated fleet, the role of the instance its first leg needs (disaggregation.takes)
    instance: str | None = None  # assigned by pump: where it goes (a slot is reserved there until `dispatched`)
    assigned_tokens: int = 0  # its uncached prompt tokens at `instance`, counted in the prefill budget until dispatched
    shed: str | None = None  # set when refused: one of SHED_REASONS
    payload: object = None  # the shell's (the router's future, the simulator's request)
