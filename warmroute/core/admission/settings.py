"""The admission queue's settings: its bounds, deadlines, fairness and spill rules (AdmissionSettings), and the one
mapping from the strategy's settings that the router and the simulator both use (`admission_settings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from warmroute.core.strategies import StrategySettings


@dataclass(kw_only=True)
class AdmissionSettings:
    enabled: bool = True
    concurrency_threshold: int = 64  # the strategy's: sizes the tenant caps and the window of arrivals
    # KV demand (kv_pressure, with the request) an instance may reach and still take a request: cache_aware's
    # hold_kv_limit, applied to every request (1000: off, as that setting's default).
    kv_limit: float = 1000.0
    max_requests: int = 4096
    max_bytes: int = 256 * 1024 * 1024
    timeout_s: float = 60.0  # a waiter's deadline: then 429
    # A waiter on KV demand waits only for its own instance, and the KV limit applies, for at most this long;
    # then any instance with a free slot takes it (what hold_timeout meant for the hold).
    patience_s: float = 5.0
    # A conversation waiting on KV demand keeps its instance this many times the fleet's mean time to first
    # token (StrategySettings.hold_keep), then any instance may take it.
    hold_keep: float = 1.5
    # An instance with at least this share of its capacity free takes any waiter; a busier one only those that lose
    # nothing there, or (aging) have waited long enough. Idle-only by default: under sustained overload any looser
    # rule moves many waiters and scatters their prefixes. Nothing starves: timeout_s bounds every wait.
    spill_headroom: float = 1.0
    aging_tokens_per_s: float = 0.0  # matched tokens a waiter is willing to lose elsewhere per second waited
    # Once the oldest waiter has waited this long, a freed slot takes the newest of the waiters it would take alike
    # (adaptive LIFO; 0: always oldest first): under sustained overload some requests wait until their deadline
    # whatever the order, and serving the newest first keeps the others' wait short instead of making all wait long.
    lifo_after_s: float = 1.0
    fair_slack: float = 4.0  # requests a tenant may be ahead of the least-served waiting tenant
    # Slots past its capacity an instance may take, as a share of it, for a tenant behind its fair share (lent
    # by the instances serving tenants ahead of theirs: the fleet's total stays under the sum of capacities).
    fair_lend: float = 0.5
    tenant_weights: dict[str, float] = field(default_factory=dict)  # 1.0 for tenants not listed
    # While other tenants are active (requests in flight or waiting), a tenant may have at most this many times
    # its weighted share of an instance's threshold awaiting their first token there, at least 1 (0: no cap).
    # The engine prefills what it holds first come first served, so one tenant's backlog in its queue delays
    # every other tenant's first tokens there; kept in the router, it waits its turn by fair share instead.
    tenant_queue_share: float = 0.0
    # Past its cap a tenant may still send there while fewer than this many requests there await their first
    # token (0: never): the engine is not left idle for want of its work.
    tenant_pending: int = 0
    # While several tenants are active, an instance with at least this many uncached prompt tokens sent there and
    # awaiting their first token takes no more requests of tenants asking for their share or more (0: no budget);
    # they wait here, where the fair order picks who goes when its prefill drains, while a tenant asking for less
    # goes first (`under_share`, `exempt`). The engine prefills first come first served: the budget bounds the
    # prefill a quiet tenant's request finds queued ahead of it. A request counts at least one token (1: strict).
    prefill_budget: int = 0
    # Record a waiting request's chain in the prefix index at the instance it waits for, as the strategy's
    # books do when a request is sent (the shells set it to the strategy's records_prefixes).
    record_queued: bool = True


def admission_settings(routing: StrategySettings, enabled: bool, **queue: Any) -> AdmissionSettings:
    """The queue's settings from the strategy's (threshold, and cache_aware's KV limit and hold timing) plus the
    queue's own bounds in `queue`: the one mapping the router and the simulator both use."""
    ca = routing.cache_aware
    return AdmissionSettings(enabled=enabled, concurrency_threshold=routing.concurrency_threshold,
                             kv_limit=ca.hold_kv_limit, patience_s=ca.hold_timeout, hold_keep=ca.hold_keep, **queue)
