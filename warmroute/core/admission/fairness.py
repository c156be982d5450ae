"""Fair shares between tenants. Each tenant has a virtual time, advanced by 1 / its weight per request admitted
(`charge`), which orders the waiters (placement's finish times): a quieter tenant's request comes level with the
head of a burst, not behind all of it. A tenant asking for less than its weighted share of the requests arriving lately is
`under_share`. While other tenants are active, a tenant's requests awaiting their first token at an instance are
capped (`capped`: its share of that engine's queue, and the instance's prefill budget). The books here count, per
tenant, what waits, what is held at each instance until its first token, and what is active at all."""

from __future__ import annotations

import math
from typing import Any

from warmroute.core.admission.capacity import Capacity
from warmroute.core.admission.settings import AdmissionSettings
from warmroute.core.admission.waiter import PREFILL, SHARE
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.popularity import Popularity

MAX_TENANTS_TRACKED = 10_000
# A tenant asking for less than this many times its weighted share of the requests arriving lately counts as under
# its share: tenants asking alike all do (none is held for the others), a burst does not.
SHARE_TOLERANCE = 1.25
ARRIVALS_WINDOW = 1  # the arrivals a tenant's share is measured over, in the fleet's thresholds (one: ~a second)


def _add(books: dict, key: Any, tokens: float) -> None:
    """Adds `tokens` to `books[key]`, dropping the key when nothing is left (float sums of whole tokens: below half
    a token is nothing)."""
    left = books.get(key, 0.0) + tokens
    if left > 0.5:
        books[key] = left
    else:
        books.pop(key, None)


class Tenants:
    """Every tenant's virtual time, activity and requests awaiting a first token; the caps that follow from them."""

    def __init__(self, settings: AdmissionSettings, fleet: Fleet, capacity: Capacity) -> None:
        self.settings = settings
        self.fleet = fleet
        self.capacity = capacity  # its reserved slots await a first token too (`capped`)
        self.served: dict[str, float] = {}  # per tenant: requests admitted from the queue / weight (virtual time)
        self.waiting: dict[str, int] = {}  # per tenant: requests waiting
        self._held: dict[str, dict[str, int]] = {}  # per tenant, per instance: assigned or awaiting a first token
        self._prefill: dict[str, float] = {}  # per instance: uncached prompt tokens assigned or awaiting a first token
        self._own_prefill: dict[tuple[str, str], float] = {}  # the same per (tenant, instance)
        self.active: dict[str, int] = {}  # per tenant with any: requests in flight, assigned or waiting
        self._active_weight = 0.0  # their tenants' weights added up
        self._arrivals = Popularity(MAX_TENANTS_TRACKED)  # each tenant's share of the requests arriving lately
        self._arrived = 0  # requests arrived (counted while a budget is set)
        self._since: dict[str, int] = {}  # per active tenant: `_arrived` when it last became active

    # -- virtual time --------------------------------------------------------------------------------------
    def charge(self, tenant: str) -> None:
        """One more request admitted for `tenant`: its virtual time advances by 1 / its weight. Requests that go
        at once count too: a tenant flooding the instances that have room is behind in the queue elsewhere."""
        if len(self.served) > MAX_TENANTS_TRACKED:  # tenants are client-chosen: keep those waiting
            self.served = {t: self.served.get(t, 0.0) for t in self.waiting}
        floor = min((self.served.get(t, 0.0) for t in self.waiting), default=0.0)
        start = max(self.served.get(tenant, 0.0), floor)  # no credit banked while it had nothing waiting
        self.served[tenant] = start + 1.0 / self.settings.tenant_weights.get(tenant, 1.0)

    def enqueued(self, tenant: str) -> None:
        """One more request of `tenant` waits. A tenant with nothing waiting starts at the least-served waiting
        tenant's virtual time: it cannot bank the share it did not use while idle."""
        if tenant not in self.waiting:
            floor = min((self.served.get(t, 0.0) for t in self.waiting), default=None)
            if floor is None:  # nothing waits: everyone starts level, and the table stays small
                self.served.clear()
            else:
                self.served[tenant] = max(self.served.get(tenant, 0.0), floor)
        self.waiting[tenant] = self.waiting.get(tenant, 0) + 1
        self.activity(tenant, +1)

    def dequeued(self, tenant: str) -> None:
        """One request of `tenant` waits no more (assigned, refused or cancelled)."""
        left = self.waiting[tenant] - 1
        if left:
            self.waiting[tenant] = left
        else:
            del self.waiting[tenant]
        self.activity(tenant, -1)

    # -- shares of the requests arriving -------------------------------------------------------------------
    def arrived(self, tenant: str) -> None:
        """A request of `tenant` arrived: its share of the requests arriving lately (`under_share`)."""
        self._arrivals.add(tenant, self._arrivals_window())
        self._arrived += 1

    def _arrivals_window(self) -> float:
        """The arrivals a tenant's share is measured over: ARRIVALS_WINDOW x the fleet's thresholds."""
        return ARRIVALS_WINDOW * self.settings.concurrency_threshold * len(self.fleet.instances)

    def under_share(self, tenant: str) -> bool:
        """With a prefill budget: whether `tenant` asks for less than its weighted share, among the active tenants,
        of the requests arriving lately (within SHARE_TOLERANCE). Its requests go first (`best_for`), at once on a
        slot lent to their instance if need be (the queue's `_lent_at_once`), and the budget does not hold them
        (`exempt`): a tenant within its share is not kept waiting by another's backlog, in the router or in the
        engine. What it asks for, not what it was sent nor the slots it holds: both shrink or grow with the
        others' backlog (a throttled burst is sent little; everyone's requests take longer, so hold more slots)."""
        if self.settings.prefill_budget <= 0:
            return False
        weight = self.settings.tenant_weights.get(tenant, 1.0)
        return self._arrivals.share(tenant) < SHARE_TOLERANCE * weight / max(self._active_weight, weight)

    def waiting_under_share(self) -> set[str]:
        """The tenants with requests waiting that are `under_share`."""
        return {t for t in self.waiting if self.under_share(t)} if self.settings.prefill_budget > 0 else set()

    # -- caps on the engines' queues -----------------------------------------------------------------------
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
        active = self.active
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
        return None if inst.pending + self.capacity.reserved.get(inst.name, 0) < s.tenant_pending else SHARE

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

    # -- requests held at the instances --------------------------------------------------------------------
    def started(self, tenant: str, name: str, uncached_tokens: float = 0.0) -> None:
        """The shell sent a request of `tenant` to instance `name` (with or without waiting here), with
        `uncached_tokens` of prefill predicted there."""
        self.hold(tenant, name, +1, uncached_tokens)
        self.activity(tenant, +1)

    def first_token(self, tenant: str, name: str, uncached_tokens: float = 0.0) -> None:
        """Its first token came: it no longer queues ahead of other requests there (its tenant stays active)."""
        self.hold(tenant, name, -1, uncached_tokens)

    def ended(self, tenant: str, name: str, got_first_token: bool, uncached_tokens: float = 0.0) -> None:
        """That request is done (answered, failed or cut off)."""
        if not got_first_token:
            self.hold(tenant, name, -1, uncached_tokens)
        self.activity(tenant, -1)

    def hold(self, tenant: str, name: str, n: int, tokens: float = 0.0) -> None:
        """`n` more requests of `tenant` assigned to or awaiting a first token at `name`, with `tokens` of prefill."""
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

    def activity(self, tenant: str, n: int) -> None:
        """`n` more requests held or waiting for `tenant`; keeps the active tenants' weights added up, and when each
        became active."""
        left = self.active.get(tenant, 0) + n
        if left > 0:
            if tenant not in self.active:
                self._active_weight += self.settings.tenant_weights.get(tenant, 1.0)
                self._since[tenant] = self._arrived
            self.active[tenant] = left
        elif tenant in self.active:
            del self.active[tenant]
            self._since.pop(tenant, None)
            self._active_weight = self._active_weight - self.settings.tenant_weights.get(tenant, 1.0) \
                if self.active else 0.0
