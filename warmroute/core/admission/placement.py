"""Which waiter an instance's free slot takes (`Placement.best_for`), and the strategy's decision once it goes
there (`decide_at`). Highest priority first; within a priority, a tenant behind its fair share first (on a slot
lent to the instance it waits for, so it keeps its cache), then the waiter losing least of its cached match there
(`gain`, plus aging), then the earliest virtual finish time; once the queue is standing, the newest of those alike
(adaptive LIFO). A waiter pinned to an instance leaves it only as `may_leave` allows."""

from __future__ import annotations

import bisect
from collections.abc import Callable

from warmroute.core.admission.capacity import Capacity
from warmroute.core.admission.fairness import Tenants
from warmroute.core.admission.settings import AdmissionSettings
from warmroute.core.admission.waiter import BUSY, KV, Waiter
from warmroute.core.admission.waitlist import Group, WaitList
from warmroute.core import disaggregation  # (the module: it and the strategies import each other through here)
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.routing_key import RoutingKey
from warmroute.core.strategies import OVERLOAD_SPILL, UNHEALTHY_FALLBACK, Decision, Strategy


def decide_at(strategy: Strategy, key: RoutingKey, fleet: Fleet, name: str, first: str | None = None) -> Decision:
    """The strategy's decision for `key` when only `name` may take it: where the queue sent a waiter, with the
    strategy's own reason, predicted match and books (NoInstanceAvailable if `name` may not serve it). While its
    healthy `first` choice is routable, whatever the strategy saw left out was full, not down: an overload spill
    (the strategy would call it a fallback from an unhealthy instance)."""
    decision = strategy.choose(key, fleet, [i for i in fleet.routable(key.model) if i.name == name])
    chosen = fleet.instances.get(first) if first is not None else None
    if decision.reason == UNHEALTHY_FALLBACK and chosen is not None and chosen.routable:
        decision.reason = OVERLOAD_SPILL
    return decision


def uncached_at(w: Waiter, name: str) -> int:
    """The prefill `w` would bring `name`: the strategy's estimate at its first choice, else its prompt beyond
    its predicted match there."""
    if name == w.first:
        return w.uncached_tokens
    return max(0, w.prompt_tokens - w.depths.get(name, 0))


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


class Placement:
    """Reads the queue's waiters (a WaitList), the instances' room and the tenants' books; changes nothing."""

    def __init__(self, settings: AdmissionSettings, fleet: Fleet, waits: WaitList, capacity: Capacity,
                 tenants: Tenants) -> None:
        self.settings = settings
        self.fleet = fleet
        self.waits = waits  # the queue's
        self.capacity = capacity
        self.tenants = tenants

    def fits(self, inst: Instance, kv_tokens: int, strict_kv: bool, lent: int = 0,
             tenant: str | None = None) -> bool:
        """Capacity.fits, for `tenant` (None: anyone) within its cap there (Tenants.capped)."""
        return self.capacity.fits(inst, kv_tokens, strict_kv, lent) and \
            (tenant is None or self.tenants.within_cap(tenant, inst))

    def fits_lent(self, inst: Instance, kv_tokens: int, strict_kv: bool, tenant: str) -> bool:
        """`fits` on a slot lent to `inst` (up to fair_lend x its capacity past it)."""
        lent = self.capacity.share_of_capacity(inst, self.settings.fair_lend)
        return self.fits(inst, kv_tokens, strict_kv, lent, tenant)

    def best_for(self, inst: Instance, now: float) -> tuple[Waiter, str] | None:
        """The waiter `inst`'s free slot should go to, and where. Highest priority first. Within a priority:

        * if a waiter for another instance, of a tenant with none waiting that `inst` may take, is behind (its
          virtual finish time, `finish`, more than fair_slack before the earliest of those `inst` may take), the
          earliest such waiter gets the slot, lent to the instance it waits for (up to fair_lend x the threshold
          past it), so it keeps its cache, while `inst` stays a slot short (`fleet_spare`). Fair shares
          fleet-wide, not only among the requests waiting for one instance: otherwise a tenant whose prefixes
          live on instances crowded by another's burst is served only as fast as those, and the burst takes
          every other instance's slots.
        * else, of those `inst` may take, the fair ones (their tenants within fair_slack of the least served)
          that gain most from its cache (deepest match there plus aging); on a tie (as for every request waiting
          for its own instance), the earliest virtual finish time: a quieter tenant's request before the backlog
          of a bursting one, the oldest first within a tenant.

        Work per call: a few steps per group of waiters alike (the WaitList's), not per waiter; a group is
        walked whole only where many of its waiters may leave their instance at once (it is down; `inst` is idle
        and they wait for a busy one; aging is on; conversations past their hold whose instance is full)."""
        if not self.capacity.fits(inst, 0, False):  # down, draining or full: nothing fits
            return None
        slot = _Slot(self, inst, now)
        for priority in sorted(self.waits.groups, reverse=True):
            groups = [g for g in self.waits.groups[priority].values() if slot.may_serve(g)]
            choice = self._band(slot, groups) if groups else None
            if choice is not None:
                return choice
        return None

    def _band(self, slot: _Slot, groups: list[Group]) -> tuple[Waiter, str] | None:
        """best_for within one priority."""
        several, under, finish = slot.several, slot.under, slot.finish
        earliest: dict[str, Waiter] = {}  # per tenant, its first waiter `inst` may take
        best: dict[str, tuple[float, Waiter]] = {}  # per tenant, its best there, by score then arrival
        for g in groups:
            found = slot.local_ends(g)
            if found is None:
                continue
            first, (score, top) = found
            if g.tenant not in earliest or first.seq < earliest[g.tenant].seq:
                earliest[g.tenant] = first
            if g.tenant not in best or (score, -top.seq) > (best[g.tenant][0], -best[g.tenant][1].seq):
                best[g.tenant] = (score, top)
        if not earliest:  # nobody here to serve: a tenant under its share waiting elsewhere may borrow the slot
            return self._earliest_borrower(slot, [g for g in groups if g.tenant in under], finish)
        if several:
            soonest = min(finish(w) for w in earliest.values())
            slack = self.settings.fair_slack
            lent = self._earliest_borrower(slot, [g for g in groups if g.tenant not in earliest], finish,
                                           lambda w: finish(w) < soonest - slack or w.tenant in under)
            if lent is not None:
                return lent
        served = self.tenants.served
        floor = min(served.get(t, 0.0) for t in earliest)
        fair = [t for t in earliest if t in under] or \
            [t for t in earliest if served.get(t, 0.0) <= floor + self.settings.fair_slack]
        score, top = max((best[t] for t in fair), key=lambda b: (b[0], -finish(b[1]), -b[1].seq))
        if self._standing(slot.now):  # adaptive LIFO: that tenant's newest of those scored alike
            top = max((slot.newest_scoring(g, score) for g in groups if g.tenant == top.tenant),
                      key=lambda w: -1 if w is None else w.seq) or top
        return top, slot.inst.name

    def _finish(self, w: Waiter) -> float:
        """`w`'s virtual finish time: its tenant's virtual time plus its place among that tenant's waiters (arrival
        order, fleet-wide) over the tenant's weight. A burst queues behind itself: a request of a quieter tenant
        (which starts at the least-served waiting tenant's time, Tenants.enqueued) comes level with the head of the
        burst, not behind all of it."""
        weight = self.settings.tenant_weights.get(w.tenant, 1.0)
        return self.tenants.served.get(w.tenant, 0.0) + self.waits.place(w) / weight

    def _standing(self, now: float) -> bool:
        """Whether the queue is standing: its oldest waiter has waited lifo_after_s or more."""
        after = self.settings.lifo_after_s
        by_seq = self.waits.by_seq
        return after > 0 and bool(by_seq) and now - next(iter(by_seq.values())).enqueued >= after

    def _earliest_borrower(self, slot: _Slot, groups: list[Group], finish: Callable[[Waiter], float],
                           allowed: Callable[[Waiter], bool] = lambda w: True) -> tuple[Waiter, str] | None:
        """Of the waiters of `groups` waiting for another instance, those `allowed`, the earliest by virtual finish
        time that its own instance may take on a lent slot, and that instance. (Within a tenant finish times go by
        arrival, and `allowed` holds for a tenant's earliest waiters if for any: each tenant's first borrower
        decides.)"""
        firsts: dict[str, Waiter] = {}
        for g in groups:
            w = slot.first_borrower(g)
            if w is not None and (g.tenant not in firsts or w.seq < firsts[g.tenant].seq):
                firsts[g.tenant] = w
        borrowers = [w for w in firsts.values() if allowed(w)]
        if not borrowers:
            return None
        lent = min(borrowers, key=lambda w: (finish(w), w.seq))
        assert lent.pin is not None
        return lent, lent.pin

    def may_borrow(self, w: Waiter, now: float) -> bool:
        """Whether the instance `w` waits for may take it on a lent slot."""
        inst = self.fleet.instances.get(w.pin or "")
        return inst is not None and self.fits_lent(inst, w.kv_tokens, now < w.strict_until, w.tenant)

    def may_leave(self, w: Waiter, name: str, free: bool, now: float) -> bool:
        """Whether a waiter pinned to another instance may go to `name`: its instance is down; or (waiting on KV
        demand) its patience is over and its instance has no slot; or, once it has kept its instance its while
        (keep_until), `name` has ample room (unless it waits on KV demand), or it has waited long enough for
        aging to outweigh what it would lose at `name`. A request waiting for a busy instance is served there
        in its turn (by priority, share and age) however long the queue: under sustained overload every wait
        is long, and a time limit would send them all elsewhere, scattering their prefixes; its deadline
        (timeout_s) bounds it. (`_Slot.leavers` relies on these being the only ways out.)"""
        pinned = self.fleet.instances.get(w.pin or "")
        if pinned is None or not pinned.routable:
            return True
        if now >= w.strict_until and w.why == KV:  # its own instance takes it if it has a slot (the KV limit
            return self.capacity.spare(pinned) <= 0  # no longer binds); else any instance (the former hold_timeout)
        if now < w.keep_until:
            return False
        if free and w.why == BUSY:  # the reference's spill (a conversation over the KV limit keeps its history)
            return True
        return gain(w, name) + self.settings.aging_tokens_per_s * (now - w.enqueued) >= 0


def _by_arrival(w: Waiter) -> float:
    return float(w.seq)


class _Slot:
    """One free slot at `inst`, at `now`: which waiters of a group it may take (their model, pool, tenant's cap
    and KV demand there; at home, or leaving another instance), and how they rank. Scores are placement's gain
    plus aging, less aging x now (the same order)."""

    def __init__(self, placement: Placement, inst: Instance, now: float) -> None:
        self.placement = placement
        self.inst = inst
        self.now = now
        self.free = placement.capacity.ample_room(inst)
        self.aging = placement.settings.aging_tokens_per_s
        self.several = len(placement.tenants.waiting) > 1  # else no one is behind: finish times go by arrival
        self.under = placement.tenants.waiting_under_share() if self.several else set()
        self.finish: Callable[[Waiter], float] = placement._finish if self.several else _by_arrival
        self._serves: dict[str | None, bool] = {}
        self._leavers: dict[int, list[Waiter]] = {}  # by id(group): `leavers`, asked up to three times a group

    def may_serve(self, g: Group) -> bool:
        """Whether `inst` may take the waiters of `g` at all: their model, pool and tenant's cap there."""
        if g.model not in self._serves:
            serving = self.placement.fleet.serving(g.model) if g.model is not None else None
            self._serves[g.model] = serving is None or self.inst.name in serving
        return self._serves[g.model] and disaggregation.takes(self.inst, g.pool) and \
            self.placement.tenants.within_cap(g.tenant, self.inst)

    def fits(self, w: Waiter) -> bool:
        """Whether `w`'s KV demand fits at `inst` (its room was checked once: Placement.best_for)."""
        return self.placement.capacity.fits(self.inst, w.kv_tokens, self.now < w.strict_until)

    def at_home(self, g: Group) -> bool:
        return g.pin is None or g.pin == self.inst.name

    def score(self, w: Waiter) -> float:
        return gain(w, self.inst.name) - self.aging * w.enqueued

    def local_ends(self, g: Group) -> tuple[Waiter, tuple[float, Waiter]] | None:
        """Of `g`'s waiters `inst` may take as its own (at home, or leaving theirs): the earliest, and the best
        by score, then arrival (with its score); None if none."""
        if self.at_home(g):
            first = next((w for w in g.by_seq.values() if self.fits(w)), None)
            if first is None:
                return None
            return first, next((-key, g.by_seq[seq]) for key, seq in g.ranked if self.fits(g.by_seq[seq]))
        leavers = self.leavers(g)
        if not leavers:
            return None
        return min(leavers, key=lambda w: w.seq), max(((self.score(w), w) for w in leavers),
                                                      key=lambda sw: (sw[0], -sw[1].seq))

    def leavers(self, g: Group) -> list[Waiter]:
        """The waiters of `g`, pinned elsewhere, that `inst` may take (`may_leave`, `fits`). Only the group's
        lossless ones can while their instance is up and no rule lets them all go (Placement.may_leave); else
        the group is walked."""
        found = self._leavers.get(id(g))
        if found is None:
            found = self._leavers[id(g)] = self._find_leavers(g)
        return found

    def _find_leavers(self, g: Group) -> list[Waiter]:
        p, inst, now = self.placement, self.inst, self.now
        pinned = p.fleet.instances.get(g.pin or "")
        kv_out = g.why == KV and now >= g.oldest().strict_until and (pinned is None or p.capacity.spare(pinned) <= 0)
        if pinned is not None and pinned.routable and self.aging == 0 and not (self.free and g.why == BUSY) \
                and not kv_out:
            some = {**g.lossless, **g.lossless_at.get(inst.name, {})}.values()
        else:
            some = g.by_seq.values()
        return [w for w in some if p.may_leave(w, inst.name, self.free, now) and self.fits(w)]

    def first_borrower(self, g: Group) -> Waiter | None:
        """`g`'s earliest waiter pinned elsewhere that `inst` could take but may not (it is not leaving), whose
        own instance may take it on a lent slot."""
        if self.at_home(g):
            return None
        p = self.placement
        pinned = p.fleet.instances.get(g.pin or "")
        if pinned is None or not p.fits_lent(pinned, 0, False, g.tenant):  # no lent slot there for anyone
            return None
        leaving = {w.seq for w in self.leavers(g)}
        return next((w for w in g.by_seq.values()
                     if w.seq not in leaving and self.fits(w) and p.may_borrow(w, self.now)), None)

    def newest_scoring(self, g: Group, score: float) -> Waiter | None:
        """`g`'s newest waiter `inst` may take as its own with this score."""
        if not self.at_home(g):
            return max((w for w in self.leavers(g) if self.score(w) == score), key=lambda w: w.seq, default=None)
        ranked = g.ranked
        lo, hi = bisect.bisect_left(ranked, (-score, -1)), bisect.bisect_right(ranked, (-score, 1 << 62))
        for i in range(hi - 1, lo - 1, -1):
            w = g.by_seq[ranked[i][1]]
            if self.fits(w):
                return w
        return None
