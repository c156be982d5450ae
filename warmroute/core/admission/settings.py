"""The admission queue's settings: its knobs as one settings model (AdmissionConfig: `admission:` in the router's
YAML, the simulator's `routing.admission`, the same names as flags and environment variables everywhere), the
queue's runtime settings built from them (AdmissionSettings), and the one mapping from the strategy's settings that
the router and the simulator both use (`admission_settings`).

The KV hold's knobs (hold_kv_limit, hold_timeout, hold_keep) stay cache_aware's (CacheAwareSettings), since a
strategy defined in the config may set its own; the queue reads them under those same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, field_validator

from warmroute.core.settings_model import GiB, KiB, MiB, SettingsModel, parse_mapping, parse_size

if TYPE_CHECKING:
    from warmroute.core.strategies import StrategySettings


class AdmissionConfig(SettingsModel):
    """The admission queue's knobs (`admission:` in YAML; each also by its name alone, as a flag and variable)."""

    enabled: bool = True
    """Admission control: a request whose chosen engine is full (engine_capacity in flight, stated or learned from its
    /metrics; or hold_kv_limit of KV demand) waits in the router, in a bounded queue with priorities and fair shares per
    tenant, instead of queueing in the engine; when an engine has room it takes the waiting request whose prefix it
    holds. An engine whose capacity is unknown is never held for. Off: every request goes at once. Set it as
    `admission: false` (YAML), --no-admission, WARMROUTE_ADMISSION=false or admission.enabled."""
    max_requests: int = Field(4096, ge=1, le=1_000_000)
    """Most requests waiting in the router; beyond, 429 (the lowest priority waiting is refused first). Formerly
    queue_max_requests (still accepted)."""
    max_bytes: Annotated[int, Field(ge=KiB, le=64 * GiB)] = 256 * MiB
    """Most bytes of request bodies waiting in the router (accepts 256MiB, ...); beyond, 429. Formerly queue_max_bytes
    (still accepted)."""
    timeout_s: float = Field(60.0, ge=0.01, le=3600)
    """Seconds a request may wait in the router; then 429 with Retry-After. Formerly queue_timeout (still accepted)."""
    spill_headroom: float = Field(1.0, ge=0.0, le=1.0)
    """A request waiting for its busy instance goes to another at once only if that one has at least this share of
    concurrency_threshold free (1: only an idle one); else it waits for its own (within timeout_s). Lower values
    spill sooner, at the cost of cache hits under load. Idle-only by default: under sustained overload any looser rule
    moves many waiters and scatters their prefixes."""
    lifo_after_s: float = Field(1.0, ge=0.0, le=3600)
    """Once the oldest waiting request has waited this many seconds, a freed slot takes the newest of the requests it
    would take alike, not the oldest (adaptive LIFO; 0: always the oldest first). Under sustained overload some requests
    wait until timeout_s whatever the order; newest first keeps most waits short instead of making every request
    wait almost that long. Requests its cache favours still go first. Formerly queue_lifo_after (still accepted)."""
    engine_queue_share: float = Field(0.0, ge=0.0, le=4.0)
    """Share of its batch an engine whose capacity was learned (not stated) may queue beyond it, except where its KV
    cache was full. The router learns that a request ended only at its last byte, so a share keeps the engine fed
    between one request's end and the next one's arrival; but what the engine queues it serves first come first
    served, past the router's order (adaptive LIFO, fair shares): under sustained overload every request then waits
    that queue's length. 0: none."""
    aging_tokens_per_s: float = Field(0.0, ge=0.0, le=1e9)
    """Prompt tokens a waiting request is willing to lose per second waited to go to another instance than its own (away
    from it, it loses at least its whole prompt); 0: never (only an idle instance takes it, or a free slot anywhere once
    its own is down). Formerly queue_aging (still accepted)."""
    fair_slack: float = Field(4.0, ge=0.0, le=1e6)
    """Requests a tenant may be ahead of the least-served waiting tenant before a freed slot goes to another."""
    fair_lend: float = Field(0.5, ge=0.0, le=1000.0)
    """Slots past its capacity an instance may take, as a share of it, for a tenant behind its fair share (lent by the
    instances serving tenants ahead of theirs: the fleet's total stays under the sum of capacities)."""
    tenant_weights: dict[str, float] = Field(default_factory=dict)
    """Fair-share weight per tenant, NAME=WEIGHT,... (0.001..1000; 1 for tenants not listed): the queue and the
    tenant caps give each tenant its weighted share."""
    tenant_queue_share: float = Field(0.0, ge=0.0, le=64.0)
    """While other tenants have requests in flight or waiting, a tenant may have at most this many times its weighted
    share of concurrency_threshold awaiting their first token at an instance (at least 1); past it, its requests wait
    in the router (see tenant_pending). Engines prefill first come first served, so one tenant's burst queued in them
    delays every other tenant's first tokens. 0: no cap. Costs throughput where the engines would batch the burst."""
    tenant_pending: int = Field(0, ge=0, le=1_000_000)
    """A tenant past its tenant_queue_share cap at an instance may still send there while fewer than this many
    requests there await their first token, so that the engine is not left idle for want of its work. 0: never past
    the cap."""
    prefill_budget: int = Field(0, ge=0, le=1 << 30)
    """While several tenants have requests in flight or waiting, an instance with at least this many uncached prompt
    tokens sent to it and awaiting their first token takes no more requests of tenants asking for their weighted
    share of the arriving requests or more; those wait in the router, where the fair shares pick whose goes next as
    its prefill drains, while a tenant asking for less goes first (at once, on a slot lent to its instance if need
    be, and past the budget while its own prefill queued there is under it). Engines prefill first come first
    served, so this bounds the prefill a quiet tenant's request finds queued ahead of it. A request counts at least one
    token, so 1 is strict: nothing may await a first token there (the heaviest isolation, at a latency cost to the
    heavy tenant even below overload; docs/deployment.md). 0: no budget. One tenant alone is never held."""

    shared_prefill_wait_s: float = Field(10.0, ge=0.0, le=600)
    """Seconds a request may wait in the router while a request sent before it to the same instance is still computing
    the prefix they share (until that one's first token or end; then it goes, and finds the prefix cached). Engines
    reuse a block of KV cache only once it is computed, so sent at once it would compute the prefix again, and both
    would wait for that. Only a streamed request (or a prefill leg) is waited for: its first token marks the end of its
    prefill. It counts at its instance meanwhile, and x-warmroute-reason says `held=...; shared_prefill`. 0: never
    waits. With admission off, no request waits."""

    @field_validator("tenant_weights", mode="before")
    @classmethod
    def _parse_weights(cls, v: Any) -> Any:
        return parse_mapping(v)

    @field_validator("tenant_weights")
    @classmethod
    def _check_weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, w in v.items() if not 0.001 <= w <= 1000]
        if bad:
            raise ValueError(f"weights must be 0.001..1000; {bad[0]!r} is not")
        return v

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _parse_size(cls, v: Any) -> Any:
        return parse_size(v)


# The admission settings' former names (flags, variables, YAML keys), still accepted: old name -> field.
ADMISSION_ALIASES: dict[str, str] = {"admission": "enabled", "queue_max_requests": "max_requests",
                                     "queue_max_bytes": "max_bytes", "queue_timeout": "timeout_s",
                                     "queue_lifo_after": "lifo_after_s", "queue_aging": "aging_tokens_per_s"}


def _default(name: str) -> Any:
    return AdmissionConfig.model_fields[name].get_default(call_default_factory=True)


@dataclass(kw_only=True)
class AdmissionSettings:
    """What the queue runs with: AdmissionConfig's knobs (same names, same defaults), the strategy's settings it
    reads, and what the shells set."""

    enabled: bool = _default("enabled")
    concurrency_threshold: int = 64  # the strategy's: sizes the tenant caps and the window of arrivals
    # KV demand (kv_pressure, with the request) an instance may reach and still take a request: cache_aware's
    # hold_kv_limit, applied to every request (1000: off, as that setting's default).
    hold_kv_limit: float = 1000.0
    max_requests: int = _default("max_requests")
    max_bytes: int = _default("max_bytes")
    timeout_s: float = _default("timeout_s")  # a waiter's deadline: then 429
    # A waiter on KV demand waits only for its own instance, and the KV limit applies, for at most this long;
    # then any instance with a free slot takes it (cache_aware's hold_timeout).
    hold_timeout: float = 5.0
    # A conversation waiting on KV demand keeps its instance this many times the fleet's mean time to first
    # token (cache_aware's hold_keep), then any instance may take it.
    hold_keep: float = 1.5
    spill_headroom: float = _default("spill_headroom")
    aging_tokens_per_s: float = _default("aging_tokens_per_s")
    engine_queue_share: float = _default("engine_queue_share")
    lifo_after_s: float = _default("lifo_after_s")
    fair_slack: float = _default("fair_slack")
    fair_lend: float = _default("fair_lend")
    tenant_weights: dict[str, float] = field(default_factory=dict)  # 1.0 for tenants not listed
    # The engine prefills what it holds first come first served, so one tenant's backlog in its queue delays
    # every other tenant's first tokens there; kept in the router, it waits its turn by fair share instead.
    tenant_queue_share: float = _default("tenant_queue_share")
    tenant_pending: int = _default("tenant_pending")
    prefill_budget: int = _default("prefill_budget")
    shared_prefill_wait_s: float = _default("shared_prefill_wait_s")
    # Record a waiting request's chain in the prefix index at the instance it waits for, as the strategy's
    # books do when a request is sent (the shells set it to the strategy's records_prefixes).
    record_queued: bool = True


def admission_settings(routing: StrategySettings, **shell: Any) -> AdmissionSettings:
    """The queue's settings from the strategy's: its admission knobs (routing.admission), the threshold, and
    cache_aware's KV hold settings, plus what the shell sets (record_queued): the one mapping the router and the
    simulator both use."""
    ca = routing.cache_aware
    return AdmissionSettings(**routing.admission.model_dump(), concurrency_threshold=routing.concurrency_threshold,
                             hold_kv_limit=ca.hold_kv_limit, hold_timeout=ca.hold_timeout, hold_keep=ca.hold_keep,
                             **shell)
