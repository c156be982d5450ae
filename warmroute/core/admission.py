"""Admission control: which requests go to an instance now, which wait in the router, and who goes next.

A request waits here only when the engine chosen for it is full (`Instance.capacity` requests in flight, or with
`kv_limit` set, its KV demand over that share of the cache), keeping its place and its prefix instead of queueing in
the engine. When an instance has room, `pump` gives it the waiter of highest priority, then of the tenant furthest
behind its fair share, then the one losing least of its cached match there. The queue is bounded and every waiter
has a deadline; the shell answers those refused with 429. Pure: the router (asyncio) and the simulator (virtual
time) drive the same object with their own clocks. The rules in full, and why: docs/architecture.md, "Admission".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from warmroute.core.disaggregation import takes
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.popularity import Popularity
from warmroute.core.routing_key import RoutingKey
from warmroute.core.strategies import (OVERLOAD_SPILL, UNHEALTHY_FALLBACK, Decision, Strategy, StrategySettings,
                                       kv_pressure)

# Why a waiting request was refused (the label values of the sheds metric).
QUEUE_FULL = "queue_full"  # the queue's bounds were reached, by requests of no lower priority
PREEMPTED = "preempted"  # removed from a full queue to make room for a higher-priority request
DEADLINE = "deadline"  # it waited its whole queue_timeout
NO_INSTANCE = "no_instance"  # no healthy instance may serve it any more (503)
SHED_REASONS = (QUEUE_FULL, PREEMPTED, DEADLINE, NO_INSTANCE)
# Why a request waited (Waiter.why; the label values of the admissions metric besides IMMEDIATE).
IMMEDIATE = "immediate"
BUSY = "engine_full"  # its instance's engine was full (as many in flight as it runs at once)
KV = "kv"  # its instance's KV demand was over kv_limit with it (a conversation: the former hold)
SHARE = "share"  # its tenant had its share of its instance's queue (tenant_queue_share) while others were active
PREFILL = "prefill"  # its instance had its prefill_budget awaiting first tokens while several tenants were active
WAIT_REASONS = (BUSY, KV, SHARE, PREFILL)
# The least a learned engine limit holds requests at: an engine queueing with fewer running is busy with long prompts
# (each step's token budget), not out of batch slots (vLLM's smallest default batch is 128), and holding requests in
# the router below it costs throughput.
MIN_LEARNED_LIMIT = 32
# A learned limit lets the engine queue this share of its batch beyond it: the router learns that a request finished
# only once its last byte is back, and sends the next one after that, so holding at exactly the batch it was seen
# running would leave the engine short of work between a request's end and the next one's arrival. Not where its KV
# cache was full: there a queued request's blocks would evict the prefixes of those to come.
ENGINE_QUEUE_SHARE = 0.25
UNBOUNDED = 1 << 30  # the room of an instance whose capacity is unknown: the router never holds requests for it
MAX_TENANTS_TRACKED = 10_000
# A tenant asking for less than this many times its weighted share of the requests arriving lately counts as under
# its share: tenants asking alike all do (none is held for the others), a burst does not.
SHARE_TOLERANCE = 1.25
ARRIVALS_WINDOW = 1  # the arrivals a tenant's share is measured over, in the fleet's thresholds (one: ~a second)


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


def _add(books: dict, key: Any, tokens: float) -> None:
    """Adds `tokens` to `books[key]`, dropping the key when nothing is left (float sums of whole tokens: below half
    a token is nothing)."""
    left = books.get(key, 0.0) + tokens
    if left > 0.5:
        books[key] = left
    else:
        books.pop(key, None)


def _count_down(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def admission_settings(routing: StrategySettings, enabled: bool, **queue: Any) -> AdmissionSettings:
    """The queue's settings from the strategy's (threshold, and cache_aware's KV limit and hold timing) plus the
    queue's own bounds in `queue`: the one mapping the router and the simulator both use."""
    ca = routing.cache_aware
    return AdmissionSettings(enabled=enabled, concurrency_threshold=routing.concurrency_threshold,
                             kv_limit=ca.hold_kv_limit, patience_s=ca.hold_timeout, hold_keep=ca.hold_keep, **queue)


def decide_at(strategy: Strategy, key: RoutingKey, fleet: Fleet, name: str, first: str | None = None) -> Decision:
    """The strategy's decision for `key` when only `name` may take it: where the queue sent a waiter, with the
    strategy's own reason, predicted match and books. While its healthy `first` choice is routable, whatever the
    strategy saw masked was full, not down: an overload spill (the strategy would call it a fallback from an
    unhealthy instance)."""
    with fleet.only(name):
        decision = strategy.choose(key, fleet)
    chosen = fleet.instances.get(first) if first is not None else None
    if decision.reason == UNHEALTHY_FALLBACK and chosen is not None and chosen.routable:
        decision.reason = OVERLOAD_SPILL
    return decision


class QueueFull(Exception):
    """The queue's bounds were reached by requests of no lower priority: the shell answers 429."""


class Admission:
    """The bounded queue, its fair shares and its dispatch; the shell reports dispatch through `dispatched`."""

    def __init__(self, settings: AdmissionSettings, fleet: Fleet) -> None:
        self.settings = settings
        self.fleet = fleet
        self.waiters: dict[int, Waiter] = {}  # by seq: arrival order
        self.bytes = 0
        self.reserved: dict[str, int] = {}  # slots given to assigned waiters not yet dispatched, per instance
        self._served: dict[str, float] = {}  # per tenant: requests admitted from the queue / weight (virtual time)
        self._waiting: dict[str, int] = {}  # per tenant: requests waiting
        self._pinned: dict[str, int] = {}  # per instance: requests waiting for it (Waiter.pin)
        self._held: dict[str, dict[str, int]] = {}  # per tenant, per instance: assigned or awaiting a first token
        self._prefill: dict[str, float] = {}  # per instance: uncached prompt tokens assigned or awaiting a first token
        self._own_prefill: dict[tuple[str, str], float] = {}  # the same per (tenant, instance)
        self._active: dict[str, int] = {}  # per tenant with any: requests in flight, assigned or waiting
        self._active_weight = 0.0  # their tenants' weights added up
        self._arrivals = Popularity(MAX_TENANTS_TRACKED)  # each tenant's share of the requests arriving lately
        self._arrived = 0  # requests arrived (counted while a budget is set)
        self._since: dict[str, int] = {}  # per active tenant: `_arrived` when it last became active
        self._seq = itertools.count()

    # -- room ----------------------------------------------------------------------------------------------
    def limit(self, inst: Instance) -> int | None:
        """Requests `inst`'s engine runs at once: the operator's figure, else what it was seen running when it
        queued, but never below MIN_LEARNED_LIMIT (an engine queueing with fewer running is busy computing long
        prefills, not out of batch slots: holding requests for it would only delay them); None while unknown."""
        cap = inst.capacity
        if cap.stated is not None or cap.learned is None:
            return cap.stated
        share = 0.0 if cap.kv_bound else ENGINE_QUEUE_SHARE  # a full KV cache would evict what a queue brings
        return max(math.ceil(cap.learned * (1 + share)), MIN_LEARNED_LIMIT)

    def spare(self, inst: Instance) -> int:
        """Requests `inst`'s engine takes before it is full: its limit less what is in flight there (other routers'
        too, where it reports them) and the slots reserved for waiters; UNBOUNDED where the limit is unknown."""
        limit = self.limit(inst)
        if limit is None:
            return UNBOUNDED
        return limit - int(inst.load) - self.reserved.get(inst.name, 0)

    def slot_wait(self, inst: Instance) -> float:
        """Seconds a request arriving now would wait in the router for a slot at `inst` (0 while its engine has
        room beyond what the requests already waiting for it will take): its place in that line, over the rate
        at which the engine frees slots (its limit per mean request duration). What cache_aware's slot_wait
        scorer adds to that instance's estimated time to first token."""
        ahead = self._pinned.get(inst.name, 0) - self.spare(inst)
        if ahead < 0:
            return 0.0
        limit = self.limit(inst) or 1
        return (ahead + 1) * self.fleet.mean_service_s / limit

    def has_room(self, inst: Instance, kv_tokens: int, strict_kv: bool = True) -> bool:
        """Under its engine's capacity (counting reserved slots), with the fleet's total under the sum of the
        capacities (`fleet_spare`), and, if `strict_kv`, under the KV limit with this request's `kv_tokens`
        (unless nothing is in flight there: an idle instance takes anything)."""
        return self.fleet_spare() > 0 and self._fits(inst, kv_tokens, strict_kv)

    def _fits(self, inst: Instance, kv_tokens: int, strict_kv: bool, lent: int = 0,
              tenant: str | None = None) -> bool:
        """has_room at one instance, `lent` slots past its capacity, for `tenant` (None: anyone) within its cap."""
        if not (inst.healthy and not inst.draining) or self.spare(inst) + lent <= 0:
            return False
        if tenant is not None and not self.within_cap(tenant, inst):
            return False
        if not strict_kv or not inst.inflight or inst.kv_capacity_tokens <= 0:
            return True
        scale = self.fleet.cache_scale.value
        return kv_pressure(inst, scale) + kv_tokens / (inst.kv_capacity_tokens * scale) <= self.settings.kv_limit

    @property
    def caps_queues(self) -> bool:
        """Whether a first token (an engine's queue shortening) may let a waiter go: a cap on those queues is set."""
        return self.settings.tenant_queue_share > 0 or self.settings.prefill_budget > 0

    def within_cap(self, tenant: str, inst: Instance) -> bool:
        """Whether `tenant` may send one more request to `inst` now (`capped`)."""
        return self.capped(tenant, inst) is None

    def capped(self, tenant: str, inst: Instance) -> str | None:
        """Why `tenant` may not send one more request to `inst` now (PREFILL, SHARE), or None. Only while another
        tenant is active: PREFILL when `inst` already has prefill_budget uncached prompt tokens assigned or
        awaiting their first token (one request may take it past the budget: a long prompt is not held back for
        ever); SHARE when the tenant has its cap of requests awaiting their first token there (tenant_queue_share x
        its weight's share, among the active tenants, of the threshold; at least 1), unless fewer than
        tenant_pending of anyone's do."""
        s = self.settings
        active = self._active
        if not self.caps_queues or len(active) - (tenant in active) < 1:
            return None
        if s.prefill_budget > 0 and self._prefill.get(inst.name, 0.0) >= s.prefill_budget \
                and not self.exempt(tenant, inst.name):
            return PREFILL
        if s.tenant_queue_share <= 0:
            return None
        weight = s.tenant_weights.get(tenant, 1.0)
        total = self._active_weight + (0.0 if tenant in active else weight)
        cap = max(1, math.ceil(s.tenant_queue_share * s.concurrency_threshold * weight / total))
        if self._held.get(tenant, {}).get(inst.name, 0) < cap:
            return None
        return None if inst.pending + self.reserved.get(inst.name, 0) < s.tenant_pending else SHARE

    def exempt(self, tenant: str, name: str) -> bool:
        """Whether `tenant` may pass instance `name`'s full prefill budget: it asks for less than its share
        (`under_share`), and it has been active over a whole window of arrivals (its share is then measured) or
        its own prefill queued there is under the budget (a tenant that has just arrived asks for nothing yet: this
        bounds what it queues in each engine until its rate shows)."""
        if not self.under_share(tenant):
            return False
        if self._arrived - self._since.get(tenant, self._arrived) >= self._arrivals_window():
            return True
        return self._own_prefill.get((tenant, name), 0.0) < self.settings.prefill_budget

    def started(self, tenant: str, name: str, uncached_tokens: float = 0.0) -> None:
        """The shell sent a request of `tenant` to instance `name` (with or without waiting here), with
        `uncached_tokens` of prefill predicted there."""
        self._hold(tenant, name, +1, uncached_tokens)
        self._activity(tenant, +1)

    def first_token(self, tenant: str, name: str, uncached_tokens: float = 0.0) -> None:
        """Its first token came: it no longer queues ahead of other requests there (its tenant stays active)."""
        self._hold(tenant, name, -1, uncached_tokens)

    def ended(self, tenant: str, name: str, got_first_token: bool, uncached_tokens: float = 0.0) -> None:
        """That request is done (answered, failed or cut off)."""
        if not got_first_token:
            self._hold(tenant, name, -1, uncached_tokens)
        self._activity(tenant, -1)

    def _hold(self, tenant: str, name: str, n: int, tokens: float = 0.0) -> None:
        if self.settings.prefill_budget > 0:  # the prefill books are read only by the budget (`capped`, `exempt`)
            # At least one token each: a request predicted wholly cached still takes a prefill step before its first
            # token (and the prediction may be wrong), so a budget of 1 means nothing awaits a first token there.
            tokens = max(1.0, tokens)
            _add(self._prefill, name, n * tokens)
            _add(self._own_prefill, (tenant, name), n * tokens)
        held = self._held.setdefault(tenant, {})
        left = held.get(name, 0) + n
        if left > 0:
            held[name] = left
        else:
            held.pop(name, None)
            if not held:
                del self._held[tenant]

    def _activity(self, tenant: str, n: int) -> None:
        """`n` more requests held or waiting for `tenant`; keeps the active tenants' weights added up, and when each
        became active."""
        left = self._active.get(tenant, 0) + n
        if left > 0:
            if tenant not in self._active:
                self._active_weight += self.settings.tenant_weights.get(tenant, 1.0)
                self._since[tenant] = self._arrived
            self._active[tenant] = left
        elif tenant in self._active:
            del self._active[tenant]
            self._since.pop(tenant, None)
            self._active_weight = self._active_weight - self.settings.tenant_weights.get(tenant, 1.0) \
                if self._active else 0.0

    def fleet_spare(self) -> int:
        """Free slots over the routable instances: fewer than theirs added up while an instance serves past its
        capacity on a slot lent to a tenant behind its share (`best_for`), so the fleet's total stays bounded."""
        return sum(self.spare(i) for i in self.fleet.routable())

    def _ample_room(self, inst: Instance) -> bool:
        """Whether `inst` has spill_headroom x its capacity free, so that any waiter may move there; an instance of
        unknown capacity only when idle (its room is not known to be ample, only not known to be short)."""
        if self.limit(inst) is None:
            return inst.load == 0 and not self.reserved.get(inst.name)
        return self.spare(inst) >= max(1, self._share_of_capacity(inst, self.settings.spill_headroom))

    def _share_of_capacity(self, inst: Instance, share: float) -> int:
        """`share` x the requests `inst`'s engine runs at once (0 where that is unknown)."""
        limit = self.limit(inst)
        return math.ceil(share * limit) if limit is not None else 0

    # -- arrival -------------------------------------------------------------------------------------------
    def waiter_for(self, decision: Decision, now: float, priority: int = 0, tenant: str = "",
                   size_bytes: int = 0, model: str | None = None, pool: str = "") -> Waiter | None:
        """None when `decision` may go now (its instance has room); else the Waiter to `offer`."""
        s = self.settings
        if s.enabled and s.prefill_budget > 0:  # each tenant's share of the requests arriving lately (`under_share`)
            self._arrivals.add(tenant, self._arrivals_window())
            self._arrived += 1
        inst = self.fleet.instances.get(decision.instance)
        capped = self.capped(tenant, inst) if s.enabled and inst is not None else None
        if not s.enabled or inst is None or (capped is None and (self.has_room(inst, decision.kv_tokens)
                                                                  or self._lent_at_once(tenant, inst, decision))):
            if s.enabled and self.waiters:
                self._charge(tenant)  # its share of capacity, while others wait for theirs
            return None
        room = inst.routable and self.spare(inst) > 0 and self.fleet_spare() > 0
        why = capped if capped is not None and room else KV if room else BUSY
        depths = self._depths(decision)
        waiter = Waiter(seq=next(self._seq), priority=priority, tenant=tenant, size_bytes=size_bytes,
                        enqueued=now, deadline=now + s.timeout_s, kv_tokens=decision.kv_tokens,
                        uncached_tokens=decision.uncached_tokens, prompt_tokens=decision.prompt_tokens, why=why,
                        pin=decision.instance if decision.blocks else None, first=decision.instance, keep_until=now,
                        strict_until=now + s.patience_s, depths=depths, blocks=decision.blocks, model=model,
                        pool=pool)
        if why == KV and decision.private:
            waiter.keep_until = now + min(s.patience_s, s.hold_keep * self.fleet.mean_ttft_s)
        return waiter

    def _lent_at_once(self, tenant: str, inst: Instance, decision: Decision) -> bool:
        """Whether a request of a tenant under its share, its instance full, goes there at once on a slot lent by
        the fleet (as `best_for` lends one when a slot frees): the fleet has a free slot, and its instance room
        within fair_lend x its capacity past it. Else it would wait for a slot its share entitles it to, held by
        the requests of a tenant past its share."""
        return (self.under_share(tenant) and self.fleet_spare() > 0
                and self._fits_lent(inst, decision.kv_tokens, True, tenant))

    def _depths(self, decision: Decision) -> dict[str, int]:
        """Matched tokens per instance holding the start of its prompt (the strategy's chain)."""
        if not decision.blocks:
            return {}
        bt = self.fleet.block_tokens
        return {n: d * bt for n, d in self.fleet.index.match_depths(decision.blocks).items()}

    def offer(self, waiter: Waiter) -> list[Waiter]:
        """Queue `waiter`; returns the waiters preempted to make room for it (their `shed` set: answer them), or
        raises QueueFull when the bounds are reached by requests of its priority or higher."""
        s = self.settings
        victims: list[Waiter] = []
        while len(self.waiters) + 1 - len(victims) > s.max_requests or \
                self.bytes + waiter.size_bytes - sum(v.size_bytes for v in victims) > s.max_bytes:
            victim = self._lowest_below(waiter.priority, victims)
            if victim is None:
                raise QueueFull(f"the router's queue is full ({len(self.waiters)} requests, {self.bytes} bytes)")
            victims.append(victim)
        for v in victims:
            self._remove(v, PREEMPTED)
        self._activate(waiter.tenant)
        self.waiters[waiter.seq] = waiter
        self._waiting[waiter.tenant] = self._waiting.get(waiter.tenant, 0) + 1
        if waiter.pin is not None:
            self._pinned[waiter.pin] = self._pinned.get(waiter.pin, 0) + 1
        self._activity(waiter.tenant, +1)
        self.bytes += waiter.size_bytes
        self._queue_prefill(waiter, +1)
        self._pending(waiter, record=True)
        return victims

    def _pending(self, w: Waiter, record: bool) -> None:
        """A waiting request's chain in the index at the instance it waits for, beyond what was there when it
        arrived: recorded while it waits (its prefix will be computed there, so the requests sharing it that
        arrive meanwhile wait there too; recorded only when sent, they scattered), forgotten when it leaves the
        queue (the shell records what it sends; left in, its own prediction at dispatch would count it as
        cached, and the engine's report that it was not would shrink the index's model of the cache)."""
        if not (self.settings.record_queued and w.pin is not None and w.blocks):
            return
        held = w.depths.get(w.pin, 0) // self.fleet.block_tokens
        if record:
            self.fleet.index.record(w.pin, w.blocks)
        elif held < len(w.blocks):
            self.fleet.index.forget(w.pin, w.blocks[held:])

    def _queue_prefill(self, w: Waiter, sign: int) -> None:
        """A waiter's prefill counts as queued at its pinned instance while it waits (Instance.queued_prefill_tokens,
        which cache_aware's cost reads): requests that could go elsewhere see the queue in the router too."""
        inst = self.fleet.instances.get(w.pin) if w.pin is not None else None
        if inst is not None:
            inst.queued_prefill_tokens = max(0.0, inst.queued_prefill_tokens + sign * w.uncached_tokens)

    def _lowest_below(self, priority: int, taken: list[Waiter]) -> Waiter | None:
        """The newest waiter of the lowest priority below `priority`, not among `taken`."""
        best: Waiter | None = None
        for w in self.waiters.values():  # arrival order: the last of the lowest wins ties
            if w.priority < priority and w not in taken and (best is None or w.priority <= best.priority):
                best = w
        return best

    def _activate(self, tenant: str) -> None:
        """A tenant with nothing waiting starts at the least-served waiting tenant's virtual time: it cannot bank
        the share it did not use while idle."""
        if tenant in self._waiting:
            return
        floor = min((self._served.get(t, 0.0) for t in self._waiting), default=None)
        if floor is None:  # nothing waits: everyone starts level, and the table stays small
            self._served.clear()
            return
        self._served[tenant] = max(self._served.get(tenant, 0.0), floor)

    # -- leaving the queue ---------------------------------------------------------------------------------
    def cancel(self, waiter: Waiter) -> None:
        """The client left: out of the queue, or its reserved slot back. Safe to call more than once."""
        if waiter.seq in self.waiters:
            self._remove(waiter)
        self.dispatched(waiter)

    def dispatched(self, waiter: Waiter) -> None:
        """The shell sent (or gave up on) an assigned waiter: its reserved slot is now a request in flight."""
        name, waiter.instance = waiter.instance, None
        if name is not None:
            self._hold(waiter.tenant, name, -1, waiter.assigned_tokens)  # the shell's `started` counts it from now on
            self._activity(waiter.tenant, -1)
            _count_down(self.reserved, name)

    def _remove(self, waiter: Waiter, shed: str | None = None) -> None:
        del self.waiters[waiter.seq]
        if waiter.pin is not None:
            _count_down(self._pinned, waiter.pin)
        left = self._waiting[waiter.tenant] - 1
        if left:
            self._waiting[waiter.tenant] = left
        else:
            del self._waiting[waiter.tenant]
        self._activity(waiter.tenant, -1)
        self.bytes -= waiter.size_bytes
        self._queue_prefill(waiter, -1)
        self._pending(waiter, record=False)
        waiter.shed = shed

    # -- dispatch ------------------------------------------------------------------------------------------
    def pump(self, now: float) -> tuple[list[Waiter], list[Waiter]]:
        """Give every instance with room the waiters it should take (their `instance` set, a slot reserved),
        and refuse those past their deadline or with no healthy instance left (their `shed` set). Returns
        (assigned, shed)."""
        shed = self._expire(now)
        assigned: list[Waiter] = []
        if not self.waiters:
            return assigned, shed
        progress = True
        while progress and self.waiters:
            progress = False
            for inst in sorted(self.fleet.routable(), key=lambda i: -self.spare(i)):
                if self.spare(inst) <= 0 or self.fleet_spare() <= 0:
                    continue
                choice = self.best_for(inst, now)
                if choice is not None:
                    self._assign(*choice)
                    assigned.append(choice[0])
                    progress = True
        return assigned, shed

    def _expire(self, now: float) -> list[Waiter]:
        shed: list[Waiter] = []
        for w in list(self.waiters.values()):
            if now >= w.deadline:
                self._remove(w, DEADLINE)
                shed.append(w)
            elif not self.fleet.routable(w.model):
                self._remove(w, NO_INSTANCE)
                shed.append(w)
        return shed

    def _assign(self, w: Waiter, name: str) -> None:
        self._remove(w)
        w.instance = name
        w.assigned_tokens = self.uncached_at(w, name)
        self.reserved[name] = self.reserved.get(name, 0) + 1
        self._hold(w.tenant, name, +1, w.assigned_tokens)
        self._activity(w.tenant, +1)
        self._charge(w.tenant)

    def _charge(self, tenant: str) -> None:
        """One more request admitted for `tenant`: its virtual time advances by 1 / its weight. Requests that go
        at once count too: a tenant flooding the instances that have room is behind in the queue elsewhere."""
        if len(self._served) > MAX_TENANTS_TRACKED:  # tenants are client-chosen: keep those waiting
            self._served = {t: self._served.get(t, 0.0) for t in self._waiting}
        floor = min((self._served.get(t, 0.0) for t in self._waiting), default=0.0)
        start = max(self._served.get(tenant, 0.0), floor)  # no credit banked while it had nothing waiting
        self._served[tenant] = start + 1.0 / self.settings.tenant_weights.get(tenant, 1.0)

    def best_for(self, inst: Instance, now: float) -> tuple[Waiter, str] | None:
        """The waiter `inst`'s free slot should go to, and where. Highest priority first. Within a priority:

        * if a waiter for another instance, of a tenant with none waiting that `inst` may take, is behind (its
          virtual finish time, `finish_times`, more than fair_slack before the earliest of those `inst` may
          take), the earliest such waiter gets the slot, lent to the instance it waits for (up to fair_lend x
          the threshold past it), so it keeps its cache, while `inst` stays a slot short (`fleet_spare`). Fair
          shares fleet-wide, not only among the requests waiting for one instance: otherwise a tenant whose
          prefixes live on instances crowded by another's burst is served only as fast as those, and the burst
          takes every other instance's slots.
        * else, of those `inst` may take, the fair ones (their tenants within fair_slack of the least served)
          that gain most from its cache (deepest match there plus aging); on a tie (as for every request waiting
          for its own instance), the earliest virtual finish time: a quieter tenant's request before the backlog
          of a bursting one, the oldest first within a tenant."""
        served, slack = self._served, self.settings.fair_slack
        tenants = len(self._waiting) > 1  # else no one is behind, and finish times go by arrival
        finish = self.finish_times() if tenants else {w.seq: float(w.seq) for w in self.waiters.values()}
        under = self._tenants_under_share() if tenants else set()
        for local, remote in self._bands(inst, now):
            if not local:  # nobody here to serve: a tenant under its share waiting elsewhere may borrow the slot
                lent = self._earliest_borrower([w for w in remote if w.tenant in under], finish, now)
                if lent is not None:
                    return lent
                continue
            first = min(finish[w.seq] for w in local)
            present = {w.tenant for w in local}
            lent = self._earliest_borrower([w for w in remote if tenants and w.tenant not in present
                                            and (finish[w.seq] < first - slack or w.tenant in under)], finish, now)
            if lent is not None:
                return lent
            floor = min(served.get(w.tenant, 0.0) for w in local)
            fair = [w for w in local if w.tenant in under] or \
                [w for w in local if served.get(w.tenant, 0.0) <= floor + slack]
            aging, name = self.settings.aging_tokens_per_s, inst.name
            def score(w: Waiter) -> float:
                return self.gain(w, name) + aging * (now - w.enqueued)
            best = max(fair, key=lambda w: (score(w), -finish[w.seq], -w.seq))
            if self._standing(now):  # adaptive LIFO: that tenant's newest of those scored alike
                top = score(best)
                best = max((w for w in fair if w.tenant == best.tenant and score(w) == top), key=lambda w: w.seq)
            return best, name
        return None

    def _standing(self, now: float) -> bool:
        """Whether the queue is standing: its oldest waiter has waited lifo_after_s or more."""
        after = self.settings.lifo_after_s
        return after > 0 and bool(self.waiters) and now - next(iter(self.waiters.values())).enqueued >= after

    def _earliest_borrower(self, candidates: list[Waiter], finish: dict[int, float],
                           now: float) -> tuple[Waiter, str] | None:
        """Of `candidates`, the earliest by virtual finish time that its own instance may take on a lent slot, and
        that instance."""
        borrowers = [w for w in candidates if self._may_borrow(w, now)]
        if not borrowers:
            return None
        lent = min(borrowers, key=lambda w: finish[w.seq])
        assert lent.pin is not None
        return lent, lent.pin

    def _tenants_under_share(self) -> set[str]:
        return {t for t in self._waiting if self.under_share(t)} if self.settings.prefill_budget > 0 else set()

    def _arrivals_window(self) -> float:
        """The arrivals a tenant's share is measured over: ARRIVALS_WINDOW x the fleet's thresholds."""
        return ARRIVALS_WINDOW * self.settings.concurrency_threshold * len(self.fleet.instances)

    def under_share(self, tenant: str) -> bool:
        """With a prefill budget: whether `tenant` asks for less than its weighted share, among the active tenants,
        of the requests arriving lately (within SHARE_TOLERANCE). Its requests go first (`best_for`), at once on a
        slot lent to their instance if need be (`_lent_at_once`), and the budget does not hold them (`exempt`): a
        tenant within its share is not kept waiting by another's backlog, in the router or in the engine. What it
        asks for, not what it was sent nor the slots it holds: both shrink or grow with the others' backlog (a
        throttled burst is sent little; everyone's requests take longer, so hold more slots)."""
        if self.settings.prefill_budget <= 0:
            return False
        weight = self.settings.tenant_weights.get(tenant, 1.0)
        return self._arrivals.share(tenant) < SHARE_TOLERANCE * weight / max(self._active_weight, weight)

    def finish_times(self) -> dict[int, float]:
        """Each waiter's virtual finish time, by seq: its tenant's virtual time plus its place among that tenant's
        waiters (arrival order, fleet-wide) over the tenant's weight. A burst queues behind itself: a request of
        a quieter tenant (which starts at the least-served waiting tenant's time, `_activate`) comes level with
        the head of the burst, not behind all of it."""
        weights, served = self.settings.tenant_weights, self._served
        last: dict[str, float] = {}
        out: dict[int, float] = {}
        for w in self.waiters.values():  # arrival order
            place = last.get(w.tenant, served.get(w.tenant, 0.0)) + 1.0 / weights.get(w.tenant, 1.0)
            out[w.seq] = last[w.tenant] = place
        return out

    def _may_borrow(self, w: Waiter, now: float) -> bool:
        """Whether the instance `w` waits for may take it on a lent slot."""
        inst = self.fleet.instances.get(w.pin or "")
        return inst is not None and self._fits_lent(inst, w.kv_tokens, now < w.strict_until, w.tenant)

    def _fits_lent(self, inst: Instance, kv_tokens: int, strict_kv: bool, tenant: str) -> bool:
        """`_fits` on a slot lent to `inst` (up to fair_lend x its capacity past it)."""
        return self._fits(inst, kv_tokens, strict_kv, self._share_of_capacity(inst, self.settings.fair_lend), tenant)

    @staticmethod
    def uncached_at(w: Waiter, name: str) -> int:
        """The prefill `w` would bring `name`: the strategy's estimate at its first choice, else its prompt beyond
        its predicted match there."""
        if name == w.first:
            return w.uncached_tokens
        return max(0, w.prompt_tokens - w.depths.get(name, 0))

    @staticmethod
    def gain(w: Waiter, name: str) -> int:
        """Matched tokens at `name` less its deepest match anywhere (0 at its best, or anywhere for a prompt
        nobody holds and no strategy placed): a request whose prefix another instance holds waits for that one,
        while one that loses nothing here goes first. Away from the instance the strategy chose for it (`pin`)
        it loses at least its whole prompt: a prompt nobody holds yet was placed where the others sharing its
        prefix go (they wait in the router too, so the index cannot show it), and scattering them costs each
        its prefix."""
        deepest = max(w.depths.values(), default=0)
        if w.pin is not None and name != w.pin:
            deepest = max(deepest, w.prompt_tokens)
        return w.depths.get(name, 0) - deepest

    def _bands(self, inst: Instance, now: float) -> Iterator[tuple[list[Waiter], list[Waiter]]]:
        """The waiters `inst` can serve (its model, room for their KV), by priority, highest first: (those its
        pin rules let it take, those waiting for another instance)."""
        free = self._ample_room(inst)
        by_priority: dict[int, tuple[list[Waiter], list[Waiter]]] = {}
        serving_cache: dict[str | None, bool] = {}
        for w in self.waiters.values():
            if w.model not in serving_cache:
                serving = self.fleet.serving(w.model) if w.model is not None else None
                serving_cache[w.model] = serving is None or inst.name in serving
            if not serving_cache[w.model] or not takes(inst, w.pool) or \
                    not self._fits(inst, w.kv_tokens, now < w.strict_until, 0, w.tenant):
                continue
            local = w.pin is None or w.pin == inst.name or self._may_leave(w, inst.name, free, now)
            by_priority.setdefault(w.priority, ([], []))[0 if local else 1].append(w)
        for p in sorted(by_priority, reverse=True):
            yield by_priority[p]

    def _may_leave(self, w: Waiter, name: str, free: bool, now: float) -> bool:
        """Whether a waiter pinned to another instance may go to `name`: its instance is down; or (waiting on KV
        demand) its patience is over and its instance has no slot; or, once it has kept its instance its while
        (keep_until), `name` has ample room (unless it waits on KV demand), or it has waited long enough for
        aging to outweigh what it would lose at `name`. A request waiting for a busy instance is served there
        in its turn (by priority, share and age) however long the queue: under sustained overload every wait
        is long, and a time limit would send them all elsewhere, scattering their prefixes; its deadline
        (timeout_s) bounds it."""
        pinned = self.fleet.instances.get(w.pin or "")
        if pinned is None or not self._up(pinned.name):
            return True
        if now >= w.strict_until and w.why == KV:  # its own instance takes it if it has a slot (the KV limit
            return self.spare(pinned) <= 0  # no longer binds); else any instance (the former hold_timeout)
        if now < w.keep_until:
            return False
        if free and w.why == BUSY:  # the reference's spill (a conversation over the KV limit keeps its history)
            return True
        return self.gain(w, name) + self.settings.aging_tokens_per_s * (now - w.enqueued) >= 0

    def _up(self, name: str) -> bool:
        inst = self.fleet.instances.get(name)
        return inst is not None and inst.healthy and not inst.draining

    # -- what the shells report ----------------------------------------------------------------------------
    def depth(self) -> dict[tuple[int, str], int]:
        """Waiting requests per (priority, tenant)."""
        out: dict[tuple[int, str], int] = {}
        for w in self.waiters.values():
            out[(w.priority, w.tenant)] = out.get((w.priority, w.tenant), 0) + 1
        return out

    def waiting_for(self) -> dict[str, tuple[int, float]]:
        """Per instance: the requests waiting for it (their first choice) and their uncached prompt tokens."""
        out: dict[str, tuple[int, float]] = {}
        for w in self.waiters.values():
            if w.first is not None:
                count, tokens = out.get(w.first, (0, 0.0))
                out[w.first] = (count + 1, tokens + w.uncached_tokens)
        return out

    def idle(self) -> bool:
        """Nothing waits and no slot is reserved: the books are back to zero."""
        return not self.waiters and not self.reserved and self.bytes == 0

    @property
    def active_tenants(self) -> dict[str, int]:
        """Per tenant with any: its requests in flight (`started`, not yet `ended`), assigned or waiting."""
        return self._active
