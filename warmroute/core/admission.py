"""Admission control: which requests go to an instance now, which wait in the router, and who goes next.

A request goes at once when the instance its strategy chose has room for it: fewer requests in flight than
the ConcurrencyThreshold, and the KV cache its requests in flight need, with this one, under `kv_limit` x its
capacity (or nothing in flight there). Otherwise it waits here rather than queue in an engine whose cache would
evict its prefix before its turn:

  * waiting for its own instance (`Waiter.pin`): a conversation whose instance's KV demand is over the limit
    (the strategy kept it there: `Decision.private`), or a request that would spill off the instance holding
    its prefix onto one with little spare capacity (under `spill_headroom` x the threshold): when every
    instance is busy, moving it only costs its cache. Pinned for a while (`keep_until`), then any instance.
  * waiting for any instance with room, when none has any.

When an instance has room (a request finished there, or it came back), `pump` gives it the waiting request
that gains the most there: the highest priority first; within a priority, the tenants that have had no more
than their fair share (start-time fair queuing in requests, by tenant weight, within `fair_slack`); among
those, the one losing least of its predicted cached match there (its match there less its deepest anywhere:
a request whose prefix another instance holds is the last this one takes) plus an aging term, so nothing
starves. The queue is bounded in requests and bytes (a full queue sheds its lowest priority first) and
every waiter has a deadline; the shell answers those with 429. All of it is pure: the router (asyncio) and the
simulator (virtual time) drive the same object with their own clocks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from warmroute.core.fleet import Fleet, Instance
from warmroute.core.routing_key import RoutingKey
from warmroute.core.strategies import OVERLOAD_SPILL, Decision, Strategy, kv_pressure

# Why a waiting request was refused (the label values of the sheds metric).
QUEUE_FULL = "queue_full"  # the queue's bounds were reached, by requests of no lower priority
PREEMPTED = "preempted"  # removed from a full queue to make room for a higher-priority request
DEADLINE = "deadline"  # it waited its whole queue_timeout
NO_INSTANCE = "no_instance"  # no healthy instance may serve it any more (503)
SHED_REASONS = (QUEUE_FULL, PREEMPTED, DEADLINE, NO_INSTANCE)
# Why a request waited (Waiter.why; the label values of the admissions metric besides IMMEDIATE).
IMMEDIATE = "immediate"
FULL = "full"  # no room at the instance chosen for it (ConcurrencyThreshold or KV demand)
AFFINITY = "affinity"  # would have spilled off its prefix's instance onto a busy one: waits for its own
WAIT_REASONS = (FULL, AFFINITY)


@dataclass(kw_only=True)
class AdmissionSettings:
    enabled: bool = True
    concurrency_threshold: int = 32  # the strategy's: an instance has room under it
    # KV demand (kv_pressure, with the request) an instance may reach and still take a request; the former
    # conversation hold's limit (StrategySettings.hold_kv_limit), now applied to every request.
    kv_limit: float = 1.4
    max_requests: int = 4096
    max_bytes: int = 256 * 1024 * 1024
    timeout_s: float = 60.0  # a waiter's deadline: then 429
    # A pinned waiter waits only for its own instance, and the KV limit applies, for at most this long; then
    # any instance with room below the ConcurrencyThreshold takes it (what hold_timeout meant for the hold).
    patience_s: float = 5.0
    # A conversation waiting on KV demand keeps its instance this many times the fleet's mean time to first
    # token (StrategySettings.hold_keep), then any instance may take it.
    hold_keep: float = 1.5
    # A request would spill off the instance holding its prefix only onto one with at least this share of
    # the threshold free; else it waits for its own. An instance this free takes such waiters anyway.
    spill_headroom: float = 0.25
    aging_tokens_per_s: float = 2000.0  # a waiter's score grows this many matched tokens' worth a second
    fair_slack: float = 4.0  # requests a tenant may be ahead of the least-served waiting tenant
    tenant_weights: dict[str, float] = field(default_factory=dict)  # 1.0 for tenants not listed


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
    why: str = FULL
    pin: str | None = None
    keep_until: float = 0.0  # until then only `pin` may take it; then others, once aging outweighs its loss there
    strict_until: float = 0.0  # until then the KV limit applies to it, and `pin` (if any) is preferred
    depths: dict[str, int] = field(default_factory=dict)
    model: str | None = None
    instance: str | None = None  # assigned by pump: where it goes (a slot is reserved there until `dispatched`)
    shed: str | None = None  # set when refused: one of SHED_REASONS
    payload: object = None  # the shell's (the router's future, the simulator's request)


def decide_at(strategy: Strategy, key: RoutingKey, fleet: Fleet, name: str) -> Decision:
    """The strategy's decision for `key` when only `name` may take it: where the queue sent a waiter, with the
    strategy's own reason, predicted match and books."""
    with fleet.only(name):
        return strategy.choose(key, fleet)


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
        self._seq = itertools.count()

    # -- room ----------------------------------------------------------------------------------------------
    def spare(self, inst: Instance) -> int:
        return self.settings.concurrency_threshold - inst.inflight - self.reserved.get(inst.name, 0)

    def has_room(self, inst: Instance, kv_tokens: int, strict_kv: bool = True) -> bool:
        """Under the ConcurrencyThreshold (counting reserved slots) and, if `strict_kv`, the KV limit with this
        request's `kv_tokens` (unless nothing is in flight there: an idle instance takes anything)."""
        if not (inst.healthy and not inst.draining) or self.spare(inst) <= 0:
            return False
        if not strict_kv or not inst.inflight or inst.kv_capacity_tokens <= 0:
            return True
        return kv_pressure(inst) + kv_tokens / inst.kv_capacity_tokens <= self.settings.kv_limit

    def _headroom(self) -> int:
        return max(1, math.ceil(self.settings.spill_headroom * self.settings.concurrency_threshold))

    # -- arrival -------------------------------------------------------------------------------------------
    def waiter_for(self, decision: Decision, now: float, priority: int = 0, tenant: str = "",
                   size_bytes: int = 0, model: str | None = None) -> Waiter | None:
        """None when `decision` may go now; else the Waiter to `offer`: no room at its instance, or a spill off
        the one instance holding its prefix onto an instance with little spare capacity."""
        s = self.settings
        if not s.enabled:
            return None
        inst = self.fleet.instances.get(decision.instance)
        if inst is None:
            return None
        depths: dict[str, int] | None = None
        pin = None
        why = FULL
        if self.has_room(inst, decision.kv_tokens):
            if decision.reason != OVERLOAD_SPILL or not decision.blocks or self.spare(inst) >= self._headroom():
                return None
            depths = self._depths(decision)
            pin = self._only_holder(depths)
            if pin is None or not self._up(pin):
                return None
            why = AFFINITY
        elif decision.private:  # the former hold: a conversation waits for its own instance's KV demand to fall
            pin = decision.instance
        waiter = Waiter(seq=next(self._seq), priority=priority, tenant=tenant, size_bytes=size_bytes,
                        enqueued=now, deadline=now + s.timeout_s, kv_tokens=decision.kv_tokens, why=why, pin=pin,
                        strict_until=now + s.patience_s, depths=depths if depths is not None else self._depths(decision),
                        model=model)
        if pin is not None and why == FULL:
            waiter.keep_until = now + min(s.patience_s, s.hold_keep * self.fleet.mean_ttft_s)
        return waiter

    def _depths(self, decision: Decision) -> dict[str, int]:
        if not decision.blocks:
            return {}
        bt = self.fleet.block_tokens
        return {n: d * bt for n, d in self.fleet.index.match_depths(decision.blocks).items()}

    @staticmethod
    def _only_holder(depths: dict[str, int]) -> str | None:
        """The instance holding the deepest match, when only one does (several: any of them will do)."""
        if not depths:
            return None
        deepest = max(depths.values())
        holders = [n for n, d in depths.items() if d == deepest]
        return holders[0] if len(holders) == 1 else None

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
        self.bytes += waiter.size_bytes
        return victims

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
        if any(w.tenant == tenant for w in self.waiters.values()):
            return
        floor = min((self._served.get(w.tenant, 0.0) for w in self.waiters.values()), default=None)
        if floor is None:  # nothing waits: everyone starts level, and the table stays small
            self._served.clear()
            return
        self._served[tenant] = max(self._served.get(tenant, 0.0), floor)

    # -- leaving the queue ---------------------------------------------------------------------------------
    def cancel(self, waiter: Waiter) -> None:
        """The client left: out of the queue, or its reserved slot back. Safe to call more than once."""
        if self.waiters.pop(waiter.seq, None) is not None:
            self.bytes -= waiter.size_bytes
        self.dispatched(waiter)

    def dispatched(self, waiter: Waiter) -> None:
        """The shell sent (or gave up on) an assigned waiter: its reserved slot is now a request in flight."""
        name, waiter.instance = waiter.instance, None
        if name is not None:
            n = self.reserved.get(name, 0) - 1
            if n > 0:
                self.reserved[name] = n
            else:
                self.reserved.pop(name, None)

    def _remove(self, waiter: Waiter, shed: str | None = None) -> None:
        del self.waiters[waiter.seq]
        self.bytes -= waiter.size_bytes
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
                if self.spare(inst) <= 0:
                    continue
                w = self.best_for(inst, now)
                if w is not None:
                    self._assign(w, inst.name)
                    assigned.append(w)
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
        self.reserved[name] = self.reserved.get(name, 0) + 1
        self._served[w.tenant] = self._served.get(w.tenant, 0.0) + 1.0 / self.settings.tenant_weights.get(w.tenant, 1.0)

    def best_for(self, inst: Instance, now: float) -> Waiter | None:
        """The waiter `inst` should take now: highest priority, then fair among tenants, then the deepest match
        there plus aging."""
        for band in self._bands(inst, now):
            floor = min(self._served.get(w.tenant, 0.0) for w in band)
            fair = [w for w in band if self._served.get(w.tenant, 0.0) <= floor + self.settings.fair_slack]
            aging, name = self.settings.aging_tokens_per_s, inst.name
            return max(fair, key=lambda w: (self.gain(w, name) + aging * (now - w.enqueued), -w.seq))
        return None

    @staticmethod
    def gain(w: Waiter, name: str) -> int:
        """Matched tokens at `name` less its deepest match anywhere (0 there, or for a prompt nobody holds): a
        request whose prefix another instance holds waits for that one, while a request that loses nothing here
        goes first."""
        return w.depths.get(name, 0) - max(w.depths.values(), default=0)

    def _bands(self, inst: Instance, now: float) -> Iterator[list[Waiter]]:
        """The waiters `inst` may take, by priority, highest first (non-empty lists)."""
        free = self.spare(inst) >= self._headroom()
        by_priority: dict[int, list[Waiter]] = {}
        serving_cache: dict[str | None, bool] = {}
        for w in self.waiters.values():
            if w.pin is not None and w.pin != inst.name and not self._may_leave(w, inst.name, free, now):
                continue
            if w.model not in serving_cache:
                serving = self.fleet.serving(w.model) if w.model is not None else None
                serving_cache[w.model] = serving is None or inst.name in serving
            if serving_cache[w.model] and self.has_room(inst, w.kv_tokens, now < w.strict_until):
                by_priority.setdefault(w.priority, []).append(w)
        for p in sorted(by_priority, reverse=True):
            yield by_priority[p]

    def _may_leave(self, w: Waiter, name: str, free: bool, now: float) -> bool:
        """Whether a waiter pinned to another instance may go to `name`: its patience is over or its instance
        is down; or, once it has kept its instance its while (keep_until), it has waited long enough for the
        aging term to outweigh what it loses at `name`; or it waits on affinity and `name` has ample room."""
        pinned = self.fleet.instances.get(w.pin or "")
        if pinned is None or not self._up(pinned.name):
            return True
        if now >= w.strict_until:  # its own instance takes it if it has a slot (the KV limit no longer binds)
            return self.spare(pinned) <= 0
        if w.why == AFFINITY and free:
            return True
        return now >= w.keep_until and self.gain(w, name) + self.settings.aging_tokens_per_s * (now - w.enqueued) >= 0

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

    def idle(self) -> bool:
        """Nothing waits and no slot is reserved: the books are back to zero."""
        return not self.waiters and not self.reserved and self.bytes == 0
