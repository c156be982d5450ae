"""Which waiter an instance's free slot takes (`Placement.best_for`), and the strategy's decision once it goes
there (`decide_at`). Highest priority first; within a priority, a tenant behind its fair share first (on a slot
lent to the instance it waits for, so it keeps its cache), then the waiter losing least of its cached match there
(`gain`, plus aging), then the earliest virtual finish time; once the queue is standing, the newest of those alike
(adaptive LIFO). A waiter pinned to an instance leaves it only as `_may_leave` allows."""

from __future__ import annotations

from collections.abc import Iterator

from warmroute.core.admission.capacity import Capacity
from warmroute.core.admission.fairness import Tenants
from warmroute.core.admission.settings import AdmissionSettings
from warmroute.core.admission.waiter import BUSY, KV, Waiter
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
    """Reads the queue's waiters (arrival order), the instances' room and the tenants' books; changes nothing."""

    def __init__(self, settings: AdmissionSettings, fleet: Fleet, waiters: dict[int, Waiter], capacity: Capacity,
                 tenants: Tenants) -> None:
        self.settings = settings
        self.fleet = fleet
        self.waiters = waiters  # the queue's, by seq
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
        served, slack = self.tenants.served, self.settings.fair_slack
        several = len(self.tenants.waiting) > 1  # else no one is behind, and finish times go by arrival
        finish = self.tenants.finish_times(self.waiters.values()) if several else \
            {w.seq: float(w.seq) for w in self.waiters.values()}
        under = self.tenants.waiting_under_share() if several else set()
        for local, remote in self._bands(inst, now):
            if not local:  # nobody here to serve: a tenant under its share waiting elsewhere may borrow the slot
                lent = self._earliest_borrower([w for w in remote if w.tenant in under], finish, now)
                if lent is not None:
                    return lent
                continue
            first = min(finish[w.seq] for w in local)
            present = {w.tenant for w in local}
            lent = self._earliest_borrower([w for w in remote if several and w.tenant not in present
                                            and (finish[w.seq] < first - slack or w.tenant in under)], finish, now)
            if lent is not None:
                return lent
            floor = min(served.get(w.tenant, 0.0) for w in local)
            fair = [w for w in local if w.tenant in under] or \
                [w for w in local if served.get(w.tenant, 0.0) <= floor + slack]
            aging, name = self.settings.aging_tokens_per_s, inst.name
            def score(w: Waiter) -> float:
                return gain(w, name) + aging * (now - w.enqueued)
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

    def _may_borrow(self, w: Waiter, now: float) -> bool:
        """Whether the instance `w` waits for may take it on a lent slot."""
        inst = self.fleet.instances.get(w.pin or "")
        return inst is not None and self.fits_lent(inst, w.kv_tokens, now < w.strict_until, w.tenant)

    def _bands(self, inst: Instance, now: float) -> Iterator[tuple[list[Waiter], list[Waiter]]]:
        """The waiters `inst` can serve (its model, room for their KV), by priority, highest first: (those its
        pin rules let it take, those waiting for another instance)."""
        free = self.capacity.ample_room(inst)
        by_priority: dict[int, tuple[list[Waiter], list[Waiter]]] = {}
        serving_cache: dict[str | None, bool] = {}
        for w in self.waiters.values():
            if w.model not in serving_cache:
                serving = self.fleet.serving(w.model) if w.model is not None else None
                serving_cache[w.model] = serving is None or inst.name in serving
            if not serving_cache[w.model] or not disaggregation.takes(inst, w.pool) or \
                    not self.fits(inst, w.kv_tokens, now < w.strict_until, 0, w.tenant):
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
        if pinned is None or not pinned.routable:
            return True
        if now >= w.strict_until and w.why == KV:  # its own instance takes it if it has a slot (the KV limit
            return self.capacity.spare(pinned) <= 0  # no longer binds); else any instance (the former hold_timeout)
        if now < w.keep_until:
            return False
        if free and w.why == BUSY:  # the reference's spill (a conversation over the KV limit keeps its history)
            return True
        return gain(w, name) + self.settings.aging_tokens_per_s * (now - w.enqueued) >= 0
