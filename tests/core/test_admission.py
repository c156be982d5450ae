"""The admission queue (core/admission.py): who waits, who goes next, bounds, deadlines, fair shares; pure."""

import pytest
from hypothesis import given, settings, strategies as st

from warmroute.core.admission import (BUSY, DEADLINE, KV, NO_INSTANCE, PREEMPTED, PREFILL, SHARE, UNBOUNDED,
                                      Admission, AdmissionSettings, QueueFull, decide_at)
from warmroute.core.strategies import (CACHE_HIT, COLD, OVERLOAD_SPILL, Decision, StrategySettings,
                                       make_strategy)

from fleet_helpers import SYSTEM, conversation_on_the_first_of_two, fleet, key


def _adm(f, capacity=None, **kw) -> Admission:
    """The queue over fleet `f` whose engines each run `capacity` requests at once (default: the threshold given,
    as the tests of the queue's rules have it; None there too: unknown, the router never holds for them)."""
    capacity = capacity if capacity is not None else kw.get("concurrency_threshold")
    for inst in f.instances.values():
        inst.capacity.stated = capacity
    return Admission(AdmissionSettings(**kw), f)


def _waiter(adm, name="x", now=0.0, priority=0, tenant="", size=0, reason=COLD, blocks=(), private=False, tokens=10):
    return adm.waiter_for(Decision(name, reason, 0, tokens, blocks, private), now, priority, tenant, size)


def _fill(f, name, n):
    f.instances[name].inflight = n


def _tenants_served(adm, f, name, n, start):
    """The tenants of the next n requests dispatched as instance `name` frees one slot at a time (a pump at start,
    start + 1, ...)."""
    order = []
    for i in range(n):
        _fill(f, name, 0)
        (w,), _ = adm.pump(start + i)
        adm.dispatched(w)
        order.append(w.tenant)
    return order


def test_a_request_goes_at_once_while_its_instance_has_room_and_waits_when_no_instance_has():
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=2)
    assert _waiter(adm, a) is None
    _fill(f, a, 2)
    w = _waiter(adm, a)
    assert w is not None and w.why == BUSY and w.pin is None  # no cache to wait for: any instance will do
    adm.offer(w)
    assigned, shed = adm.pump(0.1)
    assert assigned == [w] and w.instance == b and not shed and adm.reserved == {b: 1}
    _fill(f, b, 1)  # the reserved slot counts as taken: b is now full for anyone else
    assert adm.spare(f.instances[b]) == 0 and _waiter(adm, b) is not None
    adm.dispatched(w)
    f.instances[b].inflight = 2
    assert adm.idle()


def test_admission_off_lets_everything_go():
    f = fleet(1)
    (a,) = f.instances
    _fill(f, a, 100)
    assert _waiter(_adm(f, enabled=False, concurrency_threshold=2), a) is None


def test_a_conversation_over_the_kv_limit_waits_for_its_own_instance():
    """The former hold: a prompt kept on the one instance holding its history (private) waits while the prompts
    in flight there, with it, would need more than hold_kv_limit x its KV cache; never when nothing is in flight
    there. Pinned to its instance for hold_keep x the mean TTFT, then any instance with room takes it once the
    aging term outweighs what it would lose there, and in any case after hold_timeout."""
    f, s, a, b, k, holder = conversation_on_the_first_of_two()
    adm = _adm(f, hold_kv_limit=1.4, hold_keep=1.5)
    holder.inflight_prompt_tokens = 14_000 - k.tokens  # with it: exactly 1.4 x its KV cache
    d = s.choose(k, f)
    assert d.instance == a and d.reason == CACHE_HIT and d.private and adm.waiter_for(d, 0.0) is None
    holder.inflight_prompt_tokens += 1
    f.mean_ttft_s = 1.0
    w = adm.waiter_for(s.choose(k, f), 0.0)
    assert w is not None and w.why == KV and w.pin == a and w.keep_until == pytest.approx(1.5)
    adm.offer(w)
    assert adm.pump(1.0) == ([], [])  # b has room, but it waits for a
    holder.inflight_prompt_tokens -= k.tokens  # a request finished at a: room there now
    assert adm.pump(1.1)[0] == [w] and w.instance == a
    adm.dispatched(w)
    holder.inflight, holder.inflight_prompt_tokens = 0, 0  # nothing in flight: however large, it goes
    assert adm.waiter_for(s.choose(k, f), 0.0) is None


def test_a_pinned_waiter_goes_elsewhere_once_its_pin_runs_out():
    f, s, a, b, k, holder = conversation_on_the_first_of_two()
    adm = _adm(f, hold_kv_limit=1.4, hold_keep=1.5, hold_timeout=5.0, aging_tokens_per_s=2000.0)
    holder.inflight_prompt_tokens = 14_500  # over the KV limit with it, under sticky_kv_limit
    f.mean_ttft_s = 1.0
    w = adm.waiter_for(s.choose(k, f), 0.0)
    adm.offer(w)
    assert adm.pump(1.4) == ([], [])
    assert adm.pump(1.6)[0] == [w] and w.instance == b
    d = decide_at(s, k, f, b)
    assert d.instance == b and d.reason == OVERLOAD_SPILL


def test_an_engine_of_unknown_capacity_is_never_held_for():
    """No engine_capacity and nothing learned: whatever the ConcurrencyThreshold, the router sends at once (an
    engine batching 256 is not capped at 32)."""
    f = fleet(1)
    (a,) = f.instances
    adm = Admission(AdmissionSettings(concurrency_threshold=32), f)
    _fill(f, a, 500)
    assert adm.spare(f.instances[a]) == UNBOUNDED and _waiter(adm, a) is None
    f.instances[a].capacity.stated = 500
    assert _waiter(adm, a) is not None  # stated: at 500 in flight it is full


def test_a_request_whose_instance_is_busy_waits_for_it_rather_than_spill_onto_a_busy_one():
    """The strategy (no threshold of its own) chose the one instance holding the prefix, at the threshold: the
    request waits for it. Another busy instance does not take it (it would lose its match there) until aging
    outweighs that loss; an instance with ample room (spill_headroom) takes it at once; its own, when a slot
    frees, before an older request it holds nothing of."""
    f = fleet(2)
    a, b = sorted(f.instances)
    s = make_strategy("cache_aware", StrategySettings(concurrency_threshold=1024))  # the engines fill first
    adm = _adm(f, concurrency_threshold=8, spill_headroom=0.25, aging_tokens_per_s=200.0)
    k = key(SYSTEM)
    f.index.record(a, k.blocks())
    _fill(f, a, 8)
    _fill(f, b, 7)
    d = s.choose(k, f)
    assert d.instance == a and d.reason == CACHE_HIT
    w = adm.waiter_for(d, 0.0)
    assert w is not None and w.why == BUSY and w.pin == a
    adm.offer(w)
    assert adm.pump(0.0) == ([], [])  # b has one slot, but not ample room: it would lose its match there
    cold = _waiter(adm, a, now=0.0)  # no chain: no cache to wait for (a strategy that ignores caches)
    adm.offer(cold)
    assert adm.pump(0.1)[0] == [cold]  # ...and a request that loses nothing at b goes there
    adm.dispatched(cold)
    _fill(f, b, 8)
    _fill(f, a, 7)  # a slot at the holder
    assert adm.pump(0.2)[0] == [w] and w.instance == a
    adm.dispatched(w)
    _fill(f, a, 8)  # sent: in flight there now
    w2 = adm.waiter_for(d, 1.0)
    adm.offer(w2)
    _fill(f, b, 6)  # ample room at b (2 of 8 free): the reference's spill to an instance with more spare capacity
    assert adm.pump(1.0)[0] == [w2] and w2.instance == b
    adm.dispatched(w2)
    _fill(f, b, 7)
    w3 = adm.waiter_for(d, 2.0)
    adm.offer(w3)
    loss = w3.prompt_tokens  # away from its instance it loses its whole prompt (a holds all but its tail)
    assert adm.pump(2.0 + loss / 200.0 - 0.1) == ([], [])
    assert adm.pump(2.0 + loss / 200.0)[0] == [w3] and w3.instance == b  # aged past its loss


def test_a_freed_instance_takes_the_waiter_that_loses_least_there_and_aging_stops_starvation():
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=4, spill_headroom=0.5, aging_tokens_per_s=100.0)
    k = key(SYSTEM)
    f.index.record(a, k.blocks())
    _fill(f, a, 4)
    _fill(f, b, 4)
    warm = _waiter(adm, a, now=0.0, blocks=k.blocks(), reason=CACHE_HIT)  # a holds its prefix
    cold = _waiter(adm, a, now=1.0)
    adm.offer(warm)
    adm.offer(cold)
    _fill(f, b, 3)
    assert adm.pump(1.0)[0] == [cold]  # b takes the one that loses nothing there
    adm.dispatched(cold)
    warm2 = _waiter(adm, a, now=1.0, blocks=k.blocks(), reason=CACHE_HIT)
    adm.offer(warm2)
    assert adm.pump(1.0 + warm.depths[a] / 100.0 + 1.0)[0] == [warm]  # aged past its loss: the oldest goes


def test_priorities_go_first_and_a_full_queue_refuses_the_lowest_first():
    f = fleet(1)
    (a,) = f.instances
    _fill(f, a, 1)
    adm = _adm(f, concurrency_threshold=1, max_requests=2)
    low, mid = _waiter(adm, a, priority=-1), _waiter(adm, a, priority=0)
    adm.offer(low)
    adm.offer(mid)
    with pytest.raises(QueueFull):
        adm.offer(_waiter(adm, a, priority=-1))  # no lower one to refuse
    high = _waiter(adm, a, priority=5)
    assert adm.offer(high) == [low] and low.shed == PREEMPTED
    _fill(f, a, 0)
    assert adm.pump(0.0)[0] == [high]


def test_the_byte_bound_and_the_deadline():
    f = fleet(1)
    (a,) = f.instances
    _fill(f, a, 1)
    adm = _adm(f, concurrency_threshold=1, max_bytes=100, timeout_s=2.0)
    w = _waiter(adm, a, size=60)
    adm.offer(w)
    with pytest.raises(QueueFull):
        adm.offer(_waiter(adm, a, size=41))
    assert adm.pump(1.9) == ([], [])
    assert adm.pump(2.0) == ([], [w]) and w.shed == DEADLINE and adm.idle()


def test_waiters_are_refused_when_no_instance_may_serve_them():
    f = fleet(2)
    adm = _adm(f, concurrency_threshold=1)
    for inst in f.instances.values():
        inst.inflight = 1
    w = _waiter(adm, sorted(f.instances)[0])
    adm.offer(w)
    for inst in f.instances.values():
        inst.healthy = False
    assert adm.pump(0.0) == ([], [w]) and w.shed == NO_INSTANCE


def test_a_cancelled_waiter_leaves_no_trace_queued_or_assigned():
    f = fleet(1)
    (a,) = f.instances
    _fill(f, a, 1)
    adm = _adm(f, concurrency_threshold=1)
    w1, w2 = _waiter(adm, a, size=5), _waiter(adm, a, size=7)
    adm.offer(w1)
    adm.offer(w2)
    adm.cancel(w1)
    _fill(f, a, 0)
    assert adm.pump(0.0)[0] == [w2]
    adm.cancel(w2)  # assigned, then the client left: the reserved slot comes back
    adm.cancel(w2)
    assert adm.idle()


def test_a_tenant_bursting_cannot_starve_the_others():
    """One tenant queues 40 requests before two others queue 5 each: as slots free one at a time, the others
    are served within the fair slack of the bursting tenant, not after all of its requests."""
    f = fleet(1)
    (a,) = f.instances
    _fill(f, a, 1)
    adm = _adm(f, concurrency_threshold=1, fair_slack=1.0)
    for _ in range(40):
        adm.offer(_waiter(adm, a, tenant="noisy"))
    for t in ("x", "y"):
        for _ in range(5):
            adm.offer(_waiter(adm, a, now=0.1, tenant=t))
    order = _tenants_served(adm, f, a, 50, start=1.0)
    assert order[:16].count("noisy") <= 6 and order[:16].count("x") == 5 and order[:16].count("y") == 5


def test_tenant_weights_set_the_shares():
    f = fleet(1)
    (a,) = f.instances
    _fill(f, a, 1)
    adm = _adm(f, concurrency_threshold=1, fair_slack=0.0, tenant_weights={"big": 3.0})
    for t in ("big", "small"):
        for _ in range(40):
            adm.offer(_waiter(adm, a, tenant=t))
    order = _tenants_served(adm, f, a, 40, start=0.0)
    assert 28 <= order.count("big") <= 32


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["offer", "pump", "cancel", "finish", "down", "up"]),
                          st.integers(0, 3), st.integers(-2, 2)), max_size=60))
def test_the_books_return_to_zero_whatever_happens(ops):
    """Any sequence of arrivals, pumps, cancellations, finishes and instances going down: the queue's counts
    stay consistent, and once everything is dispatched or cancelled, nothing is left reserved or queued, nor
    counted as prefill queued at an instance (a pinned waiter's, while it waits)."""
    f = fleet(2)
    names = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=2, max_requests=5, max_bytes=50, timeout_s=3.0)
    chain = key(SYSTEM).blocks()
    live, now = [], 0.0
    for op, i, p in ops:
        now += 0.5
        inst = f.instances[names[i % 2]]
        if op == "offer":
            w = _waiter(adm, inst.name, now=now, priority=p, tenant=str(i), size=10, tokens=50,
                        blocks=chain if i % 2 else ())
            if w is not None:
                try:
                    adm.offer(w)
                    live.append(w)
                except QueueFull:
                    pass
        elif op == "pump":
            assigned, _ = adm.pump(now)
            for w in assigned:
                target = f.instances[w.instance]
                assert target.healthy and adm.spare(target) >= 0
                adm.dispatched(w)
                target.inflight += 1
        elif op == "cancel" and live:
            adm.cancel(live.pop(i % len(live)))
        elif op == "finish":
            inst.inflight = max(0, inst.inflight - 1)
        elif op in ("down", "up"):
            inst.healthy = op == "up"
        assert adm.bytes == sum(w.size_bytes for w in adm.waiters.values())
        assert len(adm.waiters) <= 5 and adm.bytes <= 50
    for w in live:
        adm.cancel(w)
    assert adm.idle() and all(x.queued_prefill_tokens == 0 for x in f.instances.values())


def test_a_cold_prompt_waits_where_it_was_placed_and_its_prefill_counts_there():
    """Nobody holds its prefix yet, but the strategy placed it (where the others sharing it go): a busy other
    instance does not take it, an idle one does; while it waits its prefill counts as queued at its instance."""
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=2)
    _fill(f, a, 2)
    _fill(f, b, 1)
    d = Decision(a, COLD, 0, 300, key(SYSTEM).blocks())
    w = adm.waiter_for(d, 0.0)
    adm.offer(w)
    assert w.pin == a and f.instances[a].queued_prefill_tokens == 300
    assert adm.pump(0.0) == ([], [])
    _fill(f, b, 0)  # idle: takes anything
    assert adm.pump(0.1)[0] == [w] and w.instance == b and f.instances[a].queued_prefill_tokens == 0


def test_requests_that_go_at_once_count_against_their_tenants_share():
    """A tenant flooding an instance that has room is charged for it: where tenants wait for the same busy
    instance, the other goes first, though it came later."""
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=1, fair_slack=1.0)
    _fill(f, b, 1)
    noisy = _waiter(adm, b, now=0.0, tenant="noisy")
    adm.offer(noisy)
    quiet = _waiter(adm, b, now=0.1, tenant="quiet")
    adm.offer(quiet)
    for _ in range(3):
        assert _waiter(adm, a, now=0.2, tenant="noisy") is None  # a has room: it goes at once
    _fill(f, a, 1)
    _fill(f, b, 0)
    assert adm.pump(0.3)[0] == [quiet]


def test_a_quiet_tenants_request_goes_before_the_backlog_of_a_burst_waiting_for_the_same_instance():
    """Among requests waiting for their own instance (no cache gain either way), order is by virtual finish
    time: a burst's tenth request finishes ten requests later in virtual time, so a request from a tenant that
    came later, with nothing waiting, goes after the burst's head, not after all of it."""
    f = fleet(1)
    (a,) = f.instances
    _fill(f, a, 1)
    adm = _adm(f, concurrency_threshold=1)
    for _ in range(10):
        adm.offer(_waiter(adm, a, tenant="burst"))
    quiet = _waiter(adm, a, now=0.5, tenant="quiet")
    adm.offer(quiet)
    order = _tenants_served(adm, f, a, 3, start=1.0)
    assert order == ["burst", "quiet", "burst"]


def _behind_at_a_busy_instance(lend: float):
    """Instance a is full, a quiet tenant's request waiting for it (its cache is there); b frees a slot, and
    only the burst's requests wait for b, the burst having had many more admitted."""
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=4, fair_slack=1.0, fair_lend=lend)
    _fill(f, a, 4)
    _fill(f, b, 4)
    for _ in range(6):
        adm.offer(_waiter(adm, b, tenant="burst", blocks=key("burst " + SYSTEM).blocks(), reason=CACHE_HIT))
    quiet = _waiter(adm, a, now=0.1, tenant="quiet", blocks=key(SYSTEM).blocks(), reason=CACHE_HIT)
    adm.offer(quiet)
    assert quiet.pin == a
    for _ in range(2):
        _fill(f, b, 3)
        (w,), _ = adm.pump(0.2)  # b serves the burst; it gets ahead of the quiet tenant
        assert w.tenant == "burst" and w.instance == b
        adm.dispatched(w)
    _fill(f, b, 3)
    return f, a, b, adm, quiet


def test_a_tenant_behind_its_share_gets_a_slot_lent_at_the_instance_holding_its_cache():
    """Fairness fleet-wide: the quiet tenant's request goes to its own instance a (keeping its cache) on the
    slot b freed, which b does not refill: the fleet's total stays under the sum of the thresholds, and an
    arrival for b waits. Lending is bounded by fair_lend x the threshold."""
    f, a, b, adm, quiet = _behind_at_a_busy_instance(lend=0.5)
    assigned, _ = adm.pump(0.3)
    assert assigned == [quiet] and quiet.instance == a
    assert adm.fleet_spare() == 0 and adm.spare(f.instances[b]) == 1
    assert _waiter(adm, b, now=0.3) is not None  # b has a slot, but the fleet has none: it waits
    adm.dispatched(quiet)
    f.instances[a].inflight += 1
    assert adm.spare(f.instances[a]) == -1
    _fill(f, a, 3)  # requests finished at a: the fleet has room again, and b serves its own
    assert adm.fleet_spare() == 2 and adm.pump(0.4)[0][0].instance in (a, b)


def test_without_lending_the_burst_keeps_the_free_slot():
    f, a, b, adm, quiet = _behind_at_a_busy_instance(lend=0.0)
    (w,), _ = adm.pump(0.3)
    assert w.tenant == "burst" and w.instance == b and quiet.instance is None


def test_a_waiting_requests_prefix_is_recorded_where_it_waits():
    """Requests sharing a prefix that arrive while the first waits see it at the instance it waits for (the
    index learns a chain only when a request is sent: without this they would scatter); not for a strategy
    that keeps no prefix index. When it leaves the queue the record goes (the shell records what it sends),
    but not what the instance held when it arrived."""
    for record in (True, False):
        f = fleet(2)
        a, b = sorted(f.instances)
        _fill(f, a, 2)
        adm = _adm(f, concurrency_threshold=2, record_queued=record)
        chain = key(SYSTEM).blocks()
        f.index.record(a, chain[:2])
        w = adm.waiter_for(Decision(a, CACHE_HIT, 2 * f.block_tokens, 300, chain), 0.0)
        adm.offer(w)
        assert f.index.match_depths(chain)[a] == (len(chain) if record else 2)
        _fill(f, a, 1)
        assert adm.pump(0.1)[0] == [w]
        assert f.index.match_depths(chain)[a] == 2


LENT: list[int] = []  # assignments away from the instance whose slot freed, over the examples (see below)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["offer"] * 3 + ["finish"] * 2 + ["cancel"]), st.integers(0, 2),
                          st.sampled_from(["x", "x", "x", "y", "z"])), min_size=30, max_size=80))
def test_lending_never_takes_the_fleet_past_its_thresholds(ops):
    """Whatever the tenants do (x the busiest): no instance goes past its threshold by more than fair_lend x it,
    and the fleet's requests in flight and reserved never exceed the sum of the thresholds; cancelled or
    dispatched, the books return to zero."""
    f = fleet(3)
    names = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=2, fair_slack=0.0, fair_lend=0.5)
    live, now = [], 0.0
    for op, i, tenant in ops:
        now += 0.1
        inst = f.instances[names[i]]
        if op == "offer":
            w = _waiter(adm, inst.name, now=now, tenant=tenant, blocks=key(tenant + SYSTEM).blocks(),
                        reason=CACHE_HIT)
            if w is None:
                inst.inflight += 1  # it went at once
            else:
                adm.offer(w)
                live.append(w)
        elif op == "finish":  # a request finished there: the shell pumps
            inst.inflight = max(0, inst.inflight - 1)
            spare = {x.name: adm.spare(x) for x in f.instances.values()}
            for w in adm.pump(now)[0]:
                LENT.append(spare[w.instance] <= 0)
                f.instances[w.instance].inflight += 1
                adm.dispatched(w)
        elif live:
            adm.cancel(live.pop(i % len(live)))
        busy = [x.inflight + adm.reserved.get(x.name, 0) for x in f.instances.values()]
        assert max(busy) <= 3 and sum(busy) <= 6
    for w in live:
        adm.cancel(w)
    assert adm.idle()


def test_the_lending_property_test_lends():
    """The test above exercises lending (run after it, in file order): some slots went to a full instance."""
    if not LENT:
        pytest.skip("run with the property test before it")
    assert any(LENT)


def test_a_tenant_past_its_queue_share_waits_while_another_tenant_is_active():
    """tenant_queue_share 1 with two active tenants: each may have half the instance's threshold (4 of 8) awaiting
    their first token there; past it a tenant's request waits (why SHARE) though the instance has room, while the
    other tenant's still go at once, and it goes once one of its own has had its first token (requests past it,
    decoding, do not count). Alone, a tenant has no cap; with tenant_pending 1 it may go past its cap while no
    request there awaits its first token."""
    f = fleet(1)
    (a,) = f.instances
    inst = f.instances[a]
    adm = _adm(f, concurrency_threshold=8, tenant_queue_share=1.0)
    for _ in range(6):  # alone: no cap
        assert _waiter(adm, a, tenant="noisy") is None
        adm.started("noisy", a)
    for _ in range(2):
        adm.ended("noisy", a, got_first_token=False)
    adm.started("quiet", a)  # another tenant is active: noisy has 4 awaiting their first token, its cap
    inst.inflight = 5
    w = _waiter(adm, a, tenant="noisy")
    assert w is not None and w.why == SHARE
    assert _waiter(adm, a, tenant="quiet") is None  # under its cap, room at the instance: at once
    adm.offer(w)
    assert adm.pump(0.1) == ([], [])  # the instance has room, but not for noisy
    adm.first_token("noisy", a)  # one of its requests is decoding now: under its cap again
    assert adm.pump(0.2) == ([w], []) and w.instance == a
    adm.dispatched(w)
    adm.started("noisy", a)
    adm.settings.tenant_pending = 1
    inst.pending = 1  # one request there awaits its first token: noisy waits past its cap
    assert _waiter(adm, a, tenant="noisy") is not None
    inst.pending = 0  # the engine's queue is empty: it may go
    assert _waiter(adm, a, tenant="noisy") is None


def test_queue_shares_follow_the_weights_of_the_active_tenants():
    """Cap = tenant_queue_share x threshold x weight / the active tenants' weights, at least 1 request."""
    f = fleet(1)
    (a,) = f.instances
    adm = _adm(f, concurrency_threshold=12, tenant_queue_share=1.0, tenant_weights={"big": 2.0})
    for t in ("small", "other"):
        adm.started(t, a)
    held = 0
    while _waiter(adm, a, tenant="big") is None:  # its weight 2 of 4: 6 of 12
        adm.started("big", a)
        held += 1
    assert held == 6
    adm.settings.tenant_queue_share = 0.01  # a tiny share still lets each tenant have one
    assert _waiter(adm, a, tenant="new") is None


def test_the_books_of_tenants_requests_return_to_zero():
    """Started, first token and ended per request, assigned and cancelled in the queue: no tenant is left active
    once all is done, and the cap counts nothing left over."""
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=4, tenant_queue_share=0.5)
    adm.started("x", a)
    adm.started("y", b)
    assert adm.active_tenants == {"x": 1, "y": 1}
    w = _waiter(adm, a, tenant="x")  # x has its 1 (0.5 x 4 / 2) awaiting a first token at a: it waits
    assert w is not None
    adm.offer(w)
    adm.first_token("x", a)
    (got,), _ = adm.pump(0.1)
    assert got is w
    adm.cancel(w)  # assigned, then the client left
    assert adm.idle() and adm.active_tenants == {"x": 1, "y": 1}
    adm.ended("x", a, got_first_token=True)
    adm.ended("y", b, got_first_token=False)
    assert not adm.active_tenants
    for _ in range(2):  # x again, with y active: its cap of 1 at a is free again
        adm.started("y", b)
        assert _waiter(adm, a, tenant="x") is None
        adm.ended("y", b, got_first_token=False)


def test_an_instance_past_its_prefill_budget_holds_the_tenants_past_their_share():
    """prefill_budget 1000 while two tenants are active (2 instances of 4 slots; noisy asked for nearly every
    request: past its share): an instance with 1000 uncached prompt tokens awaiting their first token takes no more
    requests from a tenant past its share (why PREFILL) though it has a slot, while a tenant under its share (quiet,
    its own prefill there under the budget) goes at once; as the prefill
    drains below the budget the held requests go, one at a time (one may take it past the budget). Alone, a
    tenant is never held; the books return to zero."""
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=4, prefill_budget=1000)
    for _ in range(3):  # alone: no budget
        assert _waiter(adm, a, tenant="noisy", tokens=600) is None
        adm.started("noisy", a, 600)
    adm.started("noisy", b)  # 4 in flight
    adm.started("quiet", b, 10)
    f.instances[a].inflight = 3
    burst = [_waiter(adm, a, now=0.01 * i, tenant="noisy", tokens=600, blocks=(11,)) for i in range(2)]
    assert all(w is not None and w.why == PREFILL for w in burst)
    for w in burst:
        adm.offer(w)
    assert _waiter(adm, a, tenant="quiet", tokens=600, blocks=(22,)) is None  # under its share: not held
    adm.started("quiet", a, 600)
    assert adm.pump(0.1) == ([], [])  # 2400 tokens await their first token
    for _ in range(3):
        adm.first_token("noisy", a, 600)
    assert adm.pump(0.2) == ([burst[0]], [])  # 600: under the budget; one goes, taking it to 1200
    adm.dispatched(burst[0])
    adm.started("noisy", a, 600)
    assert adm.pump(0.3) == ([], [])
    adm.first_token("quiet", a, 600)
    assert adm.pump(0.4) == ([burst[1]], [])
    adm.dispatched(burst[1])
    adm.started("noisy", a, 600)
    for _ in range(2):
        adm.first_token("noisy", a, 600)
    for t, name in (("noisy", a), ("noisy", a), ("noisy", a), ("noisy", a), ("noisy", a), ("noisy", b),
                    ("quiet", a), ("quiet", b)):
        adm.ended(t, name, got_first_token=True)
    assert adm.idle() and not adm.active_tenants
    adm.started("quiet", b, 10)
    for _ in range(4):  # noisy, past its share, at an instance where nothing awaits: the books are back to 0
        assert _waiter(adm, a, tenant="noisy", tokens=5000) is None
        adm.started("noisy", b)
    adm.started("noisy", a, 5000)  # one request past the budget
    assert _waiter(adm, a, tenant="noisy", tokens=1).why == PREFILL


def test_a_budget_of_one_token_holds_a_tenant_past_its_share_while_anything_awaits_a_first_token_there():
    """prefill_budget 1 (strict isolation): a request the router predicts wholly cached still awaits a prefill step
    (and the prediction may be wrong), so it counts as one token; while it awaits its first token, the next request
    of a tenant past its share waits (PREFILL) even if predicted wholly cached too, and goes once it came."""
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=8, prefill_budget=1)
    adm.started("quiet", b, 10)
    adm.started("noisy", b, 10)
    for i in range(20):  # noisy asks for nearly every request: past its share
        _waiter(adm, b, tenant="quiet" if i % 10 == 0 else "noisy")
    assert not adm.under_share("noisy")
    assert _waiter(adm, a, tenant="noisy", tokens=0) is None  # nothing awaits a first token at a
    adm.started("noisy", a, 0)
    held = _waiter(adm, a, tenant="noisy", tokens=0)
    assert held is not None and held.why == PREFILL
    adm.offer(held)
    assert adm.pump(0.1) == ([], [])
    adm.first_token("noisy", a, 0)
    assert adm.pump(0.2) == ([held], [])
    adm.dispatched(held)
    adm.started("noisy", a, 0)
    adm.ended("noisy", a, got_first_token=False, uncached_tokens=0)
    adm.ended("noisy", a, got_first_token=True, uncached_tokens=0)
    assert _waiter(adm, a, tenant="noisy", tokens=0) is None  # a's books are back to zero (both still active)
    adm.ended("quiet", b, got_first_token=False, uncached_tokens=10)
    adm.ended("noisy", b, got_first_token=False, uncached_tokens=10)
    assert adm.idle() and not adm.active_tenants


def test_a_tenants_share_is_what_it_asks_for_not_the_slots_it_holds():
    """Under a prefill budget, whether a tenant is under its share goes by its share of the requests arriving
    lately: a tenant asking for a fifth of them is under its share (half, between two) though it holds every slot,
    a burst asking for the rest is not though it holds none; tenants asking alike both are (none is held for the
    other); without a budget nobody is."""
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=4, prefill_budget=1000)
    for name in (a, a, b, b):
        adm.started("quiet", name)
    adm.started("burst", a)
    for i in range(40):
        _waiter(adm, a, tenant="quiet" if i % 5 == 0 else "burst")
    assert adm.under_share("quiet") and not adm.under_share("burst")
    for i in range(400):
        _waiter(adm, a, tenant="quiet" if i % 2 else "burst")
    assert adm.under_share("quiet") and adm.under_share("burst")
    assert not _adm(f, concurrency_threshold=4).under_share("quiet")


def test_a_tenant_under_its_share_passes_the_prefill_budget_only_while_its_own_prefill_there_is_under_it():
    """A tenant that has just arrived asks for nothing yet, so it is under its share; it must not flood an engine's
    queue meanwhile. With prefill_budget 1000 and two active tenants, a tenant under its share passes an instance's
    full budget while its own prefill queued there is under the budget, and is held (PREFILL) past that, until it
    has been active over a window of arrivals; the other tenant, with nothing of its own queued there, passes."""
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=8, prefill_budget=1000)
    for i in range(20):  # both ask alike: both under their share
        assert _waiter(adm, b, tenant="new" if i % 2 else "quiet") is None
    adm.started("quiet", b, 10)
    adm.started("new", a, 1200)  # the instance's whole budget, and more, is the newcomer's
    assert adm.under_share("new") and adm.under_share("quiet")
    assert _waiter(adm, a, tenant="quiet", tokens=300) is None
    adm.started("quiet", a, 300)
    held = _waiter(adm, a, tenant="new", tokens=300)
    assert held is not None and held.why == PREFILL
    # Active over a whole window of arrivals (the fleet's 16 slots), its share is measured, and under it: its own
    # prefill no longer bounds it.
    for i in range(16):
        _waiter(adm, b, tenant="new" if i % 2 else "quiet")
    assert _waiter(adm, a, tenant="new", tokens=300) is None
    adm.first_token("new", a, 1200)  # its own prefill there drains: 300 queued (the quiet one's), under the budget
    assert _waiter(adm, a, tenant="new", tokens=300) is None
    adm.ended("quiet", b, got_first_token=False, uncached_tokens=10)
    adm.ended("quiet", a, got_first_token=False, uncached_tokens=300)
    adm.ended("new", a, got_first_token=True)
    assert adm.idle() and not adm.active_tenants


def test_a_tenant_under_its_share_goes_at_once_on_a_lent_slot_and_takes_a_slot_freed_anywhere():
    """Under a prefill budget (3 slots per instance, fair_lend 1), instance a full with a burst's requests while b has
    room: a request of a tenant under its share for a goes at once on a slot lent to a (the fleet has a free one),
    while the burst's next request for a waits. With the fleet full its next request waits; when b frees a slot and
    nobody waits for b, a takes it on a lent slot, before the burst's older request. Without a budget nobody is
    under a share: it waits for a."""
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=3, prefill_budget=1000, fair_lend=1.0)
    for _ in range(20):
        _waiter(adm, b, tenant="burst")
    for name in (a, a, a, b):
        adm.started("burst", name)
        f.instances[name].inflight += 1
    assert _waiter(_adm(f, concurrency_threshold=3, fair_lend=1.0), a, tenant="quiet") is not None  # no budget
    assert _waiter(adm, a, tenant="quiet", blocks=(22,)) is None  # lent: b's free slots pay for it
    adm.started("quiet", a)
    f.instances[a].inflight += 1
    burst = _waiter(adm, a, tenant="burst", blocks=(11,))
    assert burst is not None and burst.why == BUSY
    assert _waiter(adm, b, tenant="burst") is None
    adm.started("burst", b)
    f.instances[b].inflight += 1  # the fleet is full: 4 + 2 of 6
    quiet = _waiter(adm, a, now=0.1, tenant="quiet", blocks=(23,))
    assert quiet is not None and quiet.why == BUSY
    adm.offer(burst)
    adm.offer(quiet)
    adm.ended("burst", b, got_first_token=True)
    f.instances[b].inflight -= 1
    (got,), _ = adm.pump(0.2)
    assert (got, got.instance) == (quiet, a)


@pytest.mark.parametrize("budget", [0, 1000])
def test_with_a_prefill_budget_a_tenant_under_its_share_gets_the_next_slot_lent_to_its_instance(budget):
    """Both instances full (2 slots each), noisy holding all 4 (it asked for 5 of the 6 requests lately); a noisy
    request waits for b, then a quiet one for a. When b frees a slot, with a prefill budget set the quiet tenant
    (under its share of the requests asked for) gets it, lent to a (its cache), rather than the noisy tenant's
    older request at b; without one, the fair order alone gives it to the older request, the two tenants being
    level."""
    f = fleet(2)
    a, b = sorted(f.instances)
    adm = _adm(f, concurrency_threshold=2, prefill_budget=budget, fair_lend=0.5)
    for name in (a, a, b, b):
        assert _waiter(adm, name, tenant="noisy") is None
        adm.started("noisy", name)
        f.instances[name].inflight += 1
    noisy = _waiter(adm, b, tenant="noisy", blocks=(11,))
    quiet = _waiter(adm, a, now=0.1, tenant="quiet", blocks=(22,))
    assert noisy.why == BUSY and quiet.why == BUSY
    adm.offer(noisy)
    adm.offer(quiet)
    adm.ended("noisy", b, got_first_token=True)
    f.instances[b].inflight -= 1
    (got,), _ = adm.pump(0.2)
    assert (got, got.instance) == ((quiet, a) if budget else (noisy, b))


def test_a_standing_queue_serves_its_newest_request_first_and_a_short_one_its_oldest():
    """Adaptive LIFO (lifo_after_s): under sustained overload some requests wait until their deadline whatever the
    order; once the oldest has waited lifo_after_s, a freed slot takes the newest of those it would take alike, so
    most waits stay short. Before that, the oldest goes first."""
    f = fleet(1)
    (a,) = f.instances
    adm = _adm(f, concurrency_threshold=1, lifo_after_s=1.0, timeout_s=10.0)
    _fill(f, a, 1)
    old, new = _waiter(adm, a, now=0.0), _waiter(adm, a, now=0.5)
    adm.offer(old)
    adm.offer(new)
    _fill(f, a, 0)
    assert adm.pump(0.9)[0] == [old]  # the oldest has waited under lifo_after_s: first come, first served
    adm.dispatched(old)
    _fill(f, a, 1)  # `old` is in flight
    newer = _waiter(adm, a, now=0.95)
    adm.offer(newer)
    _fill(f, a, 0)
    assert adm.pump(1.6)[0] == [newer]  # `new` has waited 1.1 s: the queue is standing, the newest goes
    adm.dispatched(newer)
    plain = _adm(fleet(1), concurrency_threshold=1, lifo_after_s=0.0)
    (b,) = plain.fleet.instances
    _fill(plain.fleet, b, 1)
    first, second = _waiter(plain, b, now=0.0), _waiter(plain, b, now=0.5)
    plain.offer(first)
    plain.offer(second)
    _fill(plain.fleet, b, 0)
    assert plain.pump(5.0)[0] == [first]  # 0: always the oldest first
