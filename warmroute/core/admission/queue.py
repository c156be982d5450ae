"""The router's admission queue (Admission): the one object the shells drive. `waiter_for` says whether a decision
goes now or waits, `offer` queues a Waiter within the queue's bounds (preempting lower priorities, else QueueFull),
`pump` gives instances with room the waiters placement picks for them and refuses those past their deadline, and
the shells report what follows (`dispatched`, `cancel`, `started`, `first_token`, `ended`). It keeps the books of
what waits (bytes, the index's record of a waiting prefix, the prefill queued at its instance); room, tenants'
shares and the choice of waiter are Capacity's, Tenants' and Placement's."""

from __future__ import annotations

import itertools

from warmroute.core.admission.capacity import Capacity
from warmroute.core.admission.fairness import Tenants
from warmroute.core.admission.placement import Placement, uncached_at
from warmroute.core.admission.settings import AdmissionSettings
from warmroute.core.admission.waiter import BUSY, DEADLINE, KV, NO_INSTANCE, PREEMPTED, Waiter
from warmroute.core.admission.waitlist import WaitList
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.strategies import Decision


class QueueFull(Exception):
    """The queue's bounds were reached by requests of no lower priority: the shell answers 429."""


class Admission:
    """The bounded queue, its fair shares and its dispatch; the shell reports dispatch through `dispatched`."""

    def __init__(self, settings: AdmissionSettings, fleet: Fleet) -> None:
        self.settings = settings
        self.fleet = fleet
        self.waits = WaitList(settings.aging_tokens_per_s)
        self.waiters: dict[int, Waiter] = self.waits.by_seq  # by seq: arrival order (read-only: `waits` keeps it)
        self.bytes = 0
        self._seq = itertools.count()
        self.capacity = Capacity(settings, fleet)
        self.tenants = Tenants(settings, fleet, self.capacity)
        self.placement = Placement(settings, fleet, self.waits, self.capacity, self.tenants)

    # -- room (Capacity's) ---------------------------------------------------------------------------------
    @property
    def reserved(self) -> dict[str, int]:
        """Slots given to assigned waiters not yet dispatched, per instance."""
        return self.capacity.reserved

    def limit(self, inst: Instance) -> int | None:
        return self.capacity.limit(inst)

    def spare(self, inst: Instance) -> int:
        return self.capacity.spare(inst)

    def fleet_spare(self) -> int:
        return self.capacity.fleet_spare()

    def has_room(self, inst: Instance, kv_tokens: int, strict_kv: bool = True) -> bool:
        return self.capacity.has_room(inst, kv_tokens, strict_kv)

    def slot_wait(self, inst: Instance) -> float:
        return self.capacity.slot_wait(inst)

    # -- tenants (Tenants') --------------------------------------------------------------------------------
    @property
    def caps_queues(self) -> bool:
        return self.tenants.caps_queues

    def capped(self, tenant: str, inst: Instance) -> str | None:
        return self.tenants.capped(tenant, inst)

    def under_share(self, tenant: str) -> bool:
        return self.tenants.under_share(tenant)

    def started(self, tenant: str, name: str, uncached_tokens: float = 0.0) -> None:
        self.tenants.started(tenant, name, uncached_tokens)

    def first_token(self, tenant: str, name: str, uncached_tokens: float = 0.0) -> None:
        self.tenants.first_token(tenant, name, uncached_tokens)

    def ended(self, tenant: str, name: str, got_first_token: bool, uncached_tokens: float = 0.0) -> None:
        self.tenants.ended(tenant, name, got_first_token, uncached_tokens)

    @property
    def active_tenants(self) -> dict[str, int]:
        """Per tenant with any: its requests in flight (`started`, not yet `ended`), assigned or waiting."""
        return self.tenants.active

    # -- arrival -------------------------------------------------------------------------------------------
    def waiter_for(self, decision: Decision, now: float, priority: int = 0, tenant: str = "",
                   size_bytes: int = 0, model: str | None = None, pool: str = "") -> Waiter | None:
        """None when `decision` may go now (its instance has room); else the Waiter to `offer`."""
        s = self.settings
        if s.enabled and s.prefill_budget > 0:  # each tenant's share of the requests arriving lately (`under_share`)
            self.tenants.arrived(tenant)
        inst = self.fleet.instances.get(decision.instance)
        capped = self.capped(tenant, inst) if s.enabled and inst is not None else None
        if not s.enabled or inst is None or (capped is None and (self.has_room(inst, decision.kv_tokens)
                                                                  or self._lent_at_once(tenant, inst, decision))):
            if s.enabled and self.waiters:
                self.tenants.charge(tenant)  # its share of capacity, while others wait for theirs
            return None
        room = inst.routable and self.spare(inst) > 0 and self.fleet_spare() > 0
        why = capped if capped is not None and room else KV if room else BUSY
        depths = self._depths(decision)
        waiter = Waiter(seq=next(self._seq), priority=priority, tenant=tenant, size_bytes=size_bytes,
                        enqueued=now, deadline=now + s.timeout_s, kv_tokens=decision.kv_tokens,
                        uncached_tokens=decision.uncached_tokens, prompt_tokens=decision.prompt_tokens, why=why,
                        pin=decision.instance if decision.blocks else None, first=decision.instance, keep_until=now,
                        strict_until=now + s.hold_timeout, depths=depths, blocks=decision.blocks, model=model,
                        pool=pool)
        if why == KV and decision.private:
            waiter.keep_until = now + min(s.hold_timeout, s.hold_keep * self.fleet.mean_ttft_s)
        return waiter

    def _lent_at_once(self, tenant: str, inst: Instance, decision: Decision) -> bool:
        """Whether a request of a tenant under its share, its instance full, goes there at once on a slot lent by
        the fleet (as `best_for` lends one when a slot frees): the fleet has a free slot, and its instance room
        within fair_lend x its capacity past it. Else it would wait for a slot its share entitles it to, held by
        the requests of a tenant past its share."""
        return (self.under_share(tenant) and self.fleet_spare() > 0
                and self.placement.fits_lent(inst, decision.kv_tokens, True, tenant))

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
            victim = self.waits.newest_below(waiter.priority, victims)
            if victim is None:
                raise QueueFull(f"the router's queue is full ({len(self.waiters)} requests, {self.bytes} bytes)")
            victims.append(victim)
        for v in victims:
            self._remove(v, PREEMPTED)
        self.tenants.enqueued(waiter.tenant)
        self.waits.add(waiter)
        if waiter.pin is not None:
            self.capacity.pin(waiter.pin)
        self.bytes += waiter.size_bytes
        self._waiting(waiter, joined=True)
        return victims

    def _waiting(self, w: Waiter, joined: bool) -> None:
        """The books of a request waiting for the instance it is pinned to (Fleet.waiting): its prefill queued
        there and, with record_queued, its chain in the index."""
        if w.pin is None:
            return
        blocks = w.blocks if self.settings.record_queued else ()
        self.fleet.waiting(w.pin, w.uncached_tokens, blocks, w.depths.get(w.pin, 0) // self.fleet.block_tokens, joined)

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
            # the shell's `started` counts it from now on
            self.tenants.hold(waiter.tenant, name, -1, waiter.assigned_tokens)
            self.tenants.activity(waiter.tenant, -1)
            self.capacity.release(name)

    def _remove(self, waiter: Waiter, shed: str | None = None) -> None:
        self.waits.remove(waiter)
        if waiter.pin is not None:
            self.capacity.unpin(waiter.pin)
        self.tenants.dequeued(waiter.tenant)
        self.bytes -= waiter.size_bytes
        self._waiting(waiter, joined=False)
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
                choice = self.placement.best_for(inst, now)
                if choice is not None:
                    self._assign(*choice)
                    assigned.append(choice[0])
                    progress = True
        return assigned, shed

    def _expire(self, now: float) -> list[Waiter]:
        """Refuses the waiters past their deadline, then those no routable instance may serve, in arrival order."""
        shed = [(w, DEADLINE) for w in self.waits.due(now)]
        stranded = [m for m in self.waits.models if not self.fleet.routable(m)]
        due = {w.seq for w, _ in shed}
        shed += [(w, NO_INSTANCE) for m in stranded for w in self.waits.of_model(m) if w.seq not in due]
        shed.sort(key=lambda ws: ws[0].seq)
        for w, why in shed:
            self._remove(w, why)
        return [w for w, _ in shed]

    def _assign(self, w: Waiter, name: str) -> None:
        self._remove(w)
        w.instance = name
        w.assigned_tokens = uncached_at(w, name)
        self.capacity.reserve(name)
        self.tenants.hold(w.tenant, name, +1, w.assigned_tokens)
        self.tenants.activity(w.tenant, +1)
        self.tenants.charge(w.tenant)

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
