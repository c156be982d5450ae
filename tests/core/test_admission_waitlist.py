"""The queue's index (core/admission/waitlist.py) and placement's use of it: the waiter a freed slot takes is the
one the rule picks when every waiter is looked at (a brute-force reading of Placement.best_for's docstring, with
placement's own per-waiter predicates), and the work per freed slot does not grow with the waiters."""

import random

from hypothesis import given, settings, strategies as st

from warmroute.core.admission import BUSY, KV, SHARE, Admission, AdmissionSettings, Waiter, gain
from warmroute.core.admission.capacity import Capacity
from warmroute.core.admission.placement import Placement
from warmroute.core.strategies import Decision
from warmroute.bench.full_queue import free_slots, full_queue

from fleet_helpers import fleet, key


def brute_best_for(p: Placement, inst, now: float):
    """best_for by looking at every waiter (the queue's arrival order)."""
    if not p.capacity.fits(inst, 0, False):
        return None
    waiters = list(p.waits.by_seq.values())
    several = len(p.tenants.waiting) > 1
    under = p.tenants.waiting_under_share() if several else set()
    weights, served = p.settings.tenant_weights, p.tenants.served

    def finish(w: Waiter) -> float:
        if not several:
            return float(w.seq)
        place = sum(1 for v in waiters if v.tenant == w.tenant and v.seq <= w.seq)
        return served.get(w.tenant, 0.0) + place / weights.get(w.tenant, 1.0)

    def score(w: Waiter) -> float:
        return gain(w, inst.name) - p.settings.aging_tokens_per_s * w.enqueued

    def borrower(candidates: list[Waiter]) -> Waiter | None:
        return min((w for w in candidates if p.may_borrow(w, now)), key=lambda w: (finish(w), w.seq), default=None)

    free = p.capacity.ample_room(inst)
    for priority in sorted({w.priority for w in waiters}, reverse=True):
        serving = [w for w in waiters if w.priority == priority
                   and (w.model is None or p.fleet.serving(w.model) is None or inst.name in p.fleet.serving(w.model))
                   and p.fits(inst, w.kv_tokens, now < w.strict_until, 0, w.tenant)]
        local = [w for w in serving if w.pin in (None, inst.name) or p.may_leave(w, inst.name, free, now)]
        remote = [w for w in serving if w not in local]
        if not local:
            lent = borrower([w for w in remote if w.tenant in under])
            if lent is not None:
                return lent, lent.pin
            continue
        first = min(finish(w) for w in local)
        present = {w.tenant for w in local}
        lent = borrower([w for w in remote if several and w.tenant not in present
                         and (finish(w) < first - p.settings.fair_slack or w.tenant in under)])
        if lent is not None:
            return lent, lent.pin
        floor = min(served.get(w.tenant, 0.0) for w in local)
        fair = [w for w in local if w.tenant in under] or \
            [w for w in local if served.get(w.tenant, 0.0) <= floor + p.settings.fair_slack]
        best = max(fair, key=lambda w: (score(w), -finish(w), -w.seq))
        if p._standing(now):
            best = max((w for w in fair if w.tenant == best.tenant and score(w) == score(best)), key=lambda w: w.seq)
        return best, inst.name
    return None


def random_queue(rng: random.Random) -> tuple[Admission, float]:
    """A queue over 1-4 instances (some full, down, draining or of unknown capacity) with up to 40 waiters of
    every kind: tenants, priorities, pins, matches, reasons, KV demands, weights, caps and budgets. Times and
    weights are multiples of powers of two, so that scores and finish times add up exactly."""
    f = fleet(rng.randint(1, 4), capacity=10_000)
    names = sorted(f.instances)
    s = AdmissionSettings(concurrency_threshold=4, aging_tokens_per_s=rng.choice([0.0, 0.0, 8.0]),
                          lifo_after_s=rng.choice([0.0, 1.0, 4.0]), fair_slack=rng.choice([0.0, 1.0, 4.0]),
                          hold_timeout=rng.choice([1.0, 5.0]), hold_kv_limit=rng.choice([1000.0, 0.5]),
                          spill_headroom=rng.choice([1.0, 0.5, 0.0]), tenant_weights=rng.choice([{}, {"a": 2.0}]),
                          tenant_queue_share=rng.choice([0.0, 0.0, 1.0]), prefill_budget=rng.choice([0, 0, 500]))
    adm = Admission(s, f)
    for inst in f.instances.values():
        inst.capacity.stated = rng.choice([4, 4, None])
        inst.inflight, inst.inflight_prompt_tokens = rng.randint(0, 5), rng.randint(0, 8000)
        inst.healthy, inst.draining = rng.random() > 0.1, rng.random() < 0.05
    now = 0.0
    for _ in range(rng.randint(1, 40)):
        now += rng.choice([0.0, 0.125, 0.5, 1.0])
        pin = rng.choice(names + [None])
        depths = {} if pin is None else {n: rng.choice([32, 64, 128]) for n in names if rng.random() < 0.5}
        tenant = rng.choice(["a", "b", "c", ""])
        w = Waiter(seq=next(adm._seq), priority=rng.choice([0, 0, 1, -1]), tenant=tenant, size_bytes=1, enqueued=now,
                   deadline=now + 100, kv_tokens=rng.choice([10, 3000, 9000]), prompt_tokens=rng.choice([0, 32, 128]),
                   why=rng.choice([BUSY, BUSY, KV, SHARE]), pin=pin, first=pin,
                   keep_until=now + rng.choice([0.0, 0.0, 1.0]), strict_until=now + s.hold_timeout, depths=depths,
                   blocks=(1, 2) if pin else ())
        adm.offer(w)
        if rng.random() < 0.3:
            adm.tenants.charge(rng.choice(["a", "b", "c", ""]))
        if rng.random() < 0.2:
            adm.tenants.started(rng.choice(["a", "b"]), rng.choice(names), rng.randint(0, 300))
    return adm, now


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_slot_goes_to_the_waiter_the_rule_picks_among_all(seed):
    rng = random.Random(seed)
    adm, now = random_queue(rng)
    for _ in range(12):  # time passes, slots free, waiters leave
        now += rng.choice([0.0, 0.5, 2.0, 6.0])
        for inst in adm.fleet.instances.values():
            got, want = adm.placement.best_for(inst, now), brute_best_for(adm.placement, inst, now)
            assert (got and (got[0].seq, got[1])) == (want and (want[0].seq, want[1])), (seed, inst.name, now)
        inst = rng.choice(list(adm.fleet.instances.values()))
        choice = adm.placement.best_for(inst, now)
        if choice is not None:
            adm._assign(*choice)
        inst.inflight = max(0, inst.inflight + rng.choice([-1, 0, 1]))
        if not adm.waiters:
            break


def test_the_work_per_freed_slot_does_not_grow_with_the_waiters(monkeypatch):
    """Slots freed one at a time on a full fleet, with 256 and with 4,096 requests waiting: placement looks at as
    many waiters for each (Capacity.fits, its check of one waiter, counted)."""
    calls = 0
    fits = Capacity.fits

    def counted(self, *args, **kw):
        nonlocal calls
        calls += 1
        return fits(self, *args, **kw)

    monkeypatch.setattr(Capacity, "fits", counted)
    for tenants in (1, 3):
        per_slot = {}
        for waiting in (256, 4096):
            adm = full_queue(waiting, tenants)
            calls = 0
            assert free_slots(adm, 64, 10.0) >= 56
            per_slot[waiting] = calls / 64
        assert per_slot[4096] <= per_slot[256] * 1.2, (tenants, per_slot)
        assert per_slot[4096] < 200, per_slot  # some per instance and group alike, none per waiter


def test_deadlines_come_due_in_order_and_the_queue_refuses_the_lowest_priority_first():
    adm = full_queue(0)
    k = key("system prompt 0 " * 40)
    waiters = []
    for i, priority in enumerate([0, -1, 1, -1, 0]):
        w = adm.waiter_for(Decision("i0", "cache_hit", k.tokens, 100, k.blocks(), False), float(i), priority, "t", 10)
        adm.offer(w)
        waiters.append(w)
    assert adm.waits.newest_below(0, []) is waiters[3] and adm.waits.newest_below(0, [waiters[3]]) is waiters[1]
    assert adm.waits.newest_below(-1, []) is None and adm.waits.newest_below(2, []) is waiters[3]
    assert [adm.waits.place(w) for w in waiters] == [1, 2, 3, 4, 5]
    _, shed = adm.pump(602.0)
    assert shed == waiters[:3] and all(w.shed == "deadline" for w in shed)
    assert [adm.waits.place(w) for w in waiters[3:]] == [1, 2]
    for w in waiters[3:]:
        adm.cancel(w)
    assert adm.idle() and not adm.waits.groups and not adm.waits.models
