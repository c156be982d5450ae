"""Disaggregated prefill and decode in the core (core/disaggregation.py): pools by role, whether a request is
split, where each leg goes, and a two-legged lifecycle's books."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from warmroute.core.admission import Admission, AdmissionSettings
from warmroute.core.disaggregation import (CACHED_AT_DECODE, DECODE, NO_PREFILL, PREFILL, PREFILL_BACKLOG,
                                           SHORT_PROMPT, SPLIT, DisaggregationSettings, decode_after, plan, pool_of)
from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.lifecycle import Lifecycle, OutOfOrder, State
from warmroute.core.strategies import NoInstanceAvailable, make_strategy

from fleet_helpers import SYSTEM, key
from test_lifecycle import Clock, books


def at_zero(f: Fleet, adm: Admission) -> bool:
    """Nothing left open: no request in flight or pending anywhere, nothing waiting or reserved."""
    instances, waiters, reserved, size, tenants, prefills = books(f, adm)
    return all(not any(counts) for _, *counts in instances) and not (waiters or any(reserved.values())
                                                                           or size or tenants or prefills)


def pd_fleet(prefill: int = 2, decode: int = 2, both: int = 0) -> Fleet:
    f = Fleet(FleetSettings())
    for i in range(prefill):
        f.add(f"p{i}", 200_000, role=PREFILL)
    for i in range(decode):
        f.add(f"d{i}", 200_000, role=DECODE)
    for i in range(both):
        f.add(f"b{i}", 200_000)
    return f


SPLIT_ALL = DisaggregationSettings(pd_threshold_tokens=0)


def test_pools_follow_roles_and_a_fleet_without_roles_is_not_disaggregated():
    f = pd_fleet(2, 1, 1)
    assert f.disaggregated
    assert sorted(i.name for i in pool_of(f, PREFILL, None)) == ["b0", "p0", "p1"]
    assert sorted(i.name for i in pool_of(f, DECODE, None)) == ["b0", "d0"]
    assert not pd_fleet(0, 0, 3).disaggregated


def test_a_long_uncached_prompt_is_split_prefill_and_decode_in_their_pools():
    f, s = pd_fleet(), make_strategy("cache_aware")
    p = plan(s, key(SYSTEM), f, SPLIT_ALL)
    assert p.split and p.why == SPLIT and p.pool == PREFILL and p.first is p.prefill
    assert p.prefill.instance.startswith("p") and p.decode.instance.startswith("d")


def test_the_prefill_leg_goes_where_the_prefix_is_cached():
    f, s = pd_fleet(prefill=4), make_strategy("cache_aware")
    k = key(SYSTEM, "first")
    f.index.record("p3", k.blocks())
    p = plan(s, key(SYSTEM, "second"), f, SPLIT_ALL)
    assert p.prefill.instance == "p3" and p.prefill.matched_tokens > 0


def test_below_the_threshold_a_request_goes_whole_to_its_decode_instance():
    f, s = pd_fleet(), make_strategy("cache_aware")
    k = key("short system", "hi")
    p = plan(s, k, f, DisaggregationSettings(pd_threshold_tokens=k.tokens + 1))
    assert not p.split and p.why == SHORT_PROMPT and p.pool == DECODE and p.decode.instance.startswith("d")


def test_a_prompt_cached_at_a_decode_instance_stays_there_whole():
    f, s = pd_fleet(), make_strategy("cache_aware")
    f.index.record("d1", key(SYSTEM, "first").blocks())
    k = key(SYSTEM, "second")
    p = plan(s, k, f, DisaggregationSettings(pd_threshold_tokens=k.tokens // 4))
    assert (p.split, p.why, p.decode.instance) == (False, CACHED_AT_DECODE, "d1")


def test_with_no_prefill_instance_up_a_request_goes_whole_and_with_no_decode_instance_none_is_found():
    f, s = pd_fleet(), make_strategy("cache_aware")
    for name in ("p0", "p1"):
        f.instances[name].healthy = False
    assert plan(s, key(SYSTEM), f, SPLIT_ALL).why == NO_PREFILL
    for name in ("d0", "d1"):
        f.instances[name].healthy = False
    with pytest.raises(NoInstanceAvailable):
        plan(s, key(SYSTEM), f, SPLIT_ALL)


def test_an_instance_of_both_roles_never_takes_both_legs_of_one_request():
    f, s = pd_fleet(0, 0, 2), make_strategy("cache_aware")
    f.add("d0", 200_000, role=DECODE)
    for _ in range(20):
        p = plan(s, key(SYSTEM), f, SPLIT_ALL)
        assert p.prefill is None or p.prefill.instance != p.decode.instance
    assert decode_after(s, key(SYSTEM), f, "b0").instance != "b0"


@settings(max_examples=60, deadline=None)
@given(threshold=st.integers(0, 3000), user=st.text(min_size=1, max_size=400), cached=st.booleans())
def test_split_exactly_when_the_decode_instance_would_compute_at_least_the_threshold(threshold, user, cached):
    f, s = pd_fleet(), make_strategy("cache_aware")
    if cached:
        f.index.record("d0", key(SYSTEM, "earlier").blocks())
    p = plan(s, key(SYSTEM, user), f, DisaggregationSettings(pd_threshold_tokens=threshold))
    worth = p.decode.uncached_tokens >= max(1, threshold)
    assert p.split == (worth and p.why == SPLIT)
    if worth and not p.split:  # the prefill pool holds less of it than its decode instance: slower there
        assert p.why == PREFILL_BACKLOG


def test_a_request_the_prefill_pools_queue_would_delay_goes_whole_to_its_decode_instance():
    f, s = pd_fleet(), make_strategy("cache_aware")
    for name in ("p0", "p1"):
        f.instances[name].queued_prefill_tokens = 50_000  # five seconds of prefill queued at each
    p = plan(s, key(SYSTEM), f, SPLIT_ALL)
    assert (p.split, p.why) == (False, PREFILL_BACKLOG)
    f.instances["p1"].queued_prefill_tokens = 0
    assert plan(s, key(SYSTEM), f, SPLIT_ALL).prefill.instance == "p1"


# -- the lifecycle of a request in two legs ---------------------------------------------------------------------
def two_legs():
    f = pd_fleet(1, 1)
    adm = Admission(AdmissionSettings(), f)
    clock = Clock()
    life = Lifecycle(f, adm, clock)
    life.keyed(key(SYSTEM), "t")
    p = plan(make_strategy("cache_aware"), life.key, f, SPLIT_ALL)
    life.admit(p.first, 0.0, pool=p.pool)
    return f, adm, clock, life, p


def test_a_handed_over_request_keeps_each_legs_books_apart_and_closes_both():
    f, adm, clock, life, p = two_legs()
    pre = life.dispatch(p.prefill, role=PREFILL)
    assert f.instances["p0"].queued_prefill_tokens == p.prefill.uncached_tokens > 0
    clock.now = 0.5
    life.first_token()
    life.feedback(0)
    assert life.handover() is pre and life.state is State.ADMITTED and pre.done
    assert f.instances["p0"].inflight == 0 and f.index.entries("p0") > 0  # its prefix stays cached there
    dec = life.dispatch(p.decode, role=DECODE)
    assert dec.uncached_tokens == 0 and f.instances["d0"].queued_prefill_tokens == 0  # no prompt computed there
    assert f.instances["d0"].inflight == 1 and f.index.entries("d0") > 0  # its KV lands there
    life.first_token()
    life.finish()
    assert at_zero(f, adm) and [leg.role for leg in life.legs] == [PREFILL, DECODE]


def test_legs_sent_together_close_apart_and_a_client_leaving_closes_both():
    f, adm, clock, life, p = two_legs()
    pre = life.dispatch(p.prefill, role=PREFILL)
    dec = life.dispatch(p.decode, role=DECODE, alongside=True)
    assert f.instances["p0"].inflight == f.instances["d0"].inflight == 1 and life.leg is dec
    with pytest.raises(OutOfOrder):
        life.dispatch(p.decode, role=DECODE, alongside=True)
    life.leg_finished(pre, answered=True)
    with pytest.raises(OutOfOrder):
        life.leg_finished(pre, answered=True)
    assert f.instances["p0"].inflight == 0 and pre.got_first
    life.cancel()
    assert at_zero(f, adm) and dec.done


def test_a_client_leaving_during_the_prefill_leg_of_legs_sent_together_closes_both():
    f, adm, clock, life, p = two_legs()
    life.dispatch(p.prefill, role=PREFILL)
    life.dispatch(p.decode, role=DECODE, alongside=True)
    life.close()
    assert at_zero(f, adm) and all(leg.done for leg in life.legs)


def test_handover_is_refused_from_a_whole_request_and_before_the_prefill_answered():
    f, adm, clock, life, p = two_legs()
    life.dispatch(p.prefill, role=PREFILL)
    before = books(f, adm)
    with pytest.raises(OutOfOrder):
        life.handover()
    assert books(f, adm) == before
    life.retry()  # the prefill leg failed: its books close, and it may go to another prefill instance
    life.dispatch(p.decode)
    life.first_token()
    with pytest.raises(OutOfOrder):
        life.handover()
    life.finish()
    assert at_zero(f, adm)


def test_a_waiting_request_is_given_a_slot_only_at_an_instance_of_its_pool():
    f = pd_fleet(1, 1)
    for inst in f.instances.values():
        inst.capacity.stated = 1
    adm = Admission(AdmissionSettings(concurrency_threshold=1), f)
    s = make_strategy("cache_aware")
    busy = Lifecycle(f, adm, Clock())
    busy.keyed(key("other " * 400), "t")
    first = plan(s, busy.key, f, SPLIT_ALL)
    busy.admit(first.first, 0.0, pool=first.pool)
    busy.dispatch(first.prefill, role=PREFILL)
    busy.first_token()  # the prefill instance is full, its prompt computed (no queue to make a split slower)
    life = Lifecycle(f, adm, Clock())
    life.keyed(key(SYSTEM), "t")
    p = plan(s, life.key, f, SPLIT_ALL)
    life.admit(p.first, 0.0, pool=p.pool)
    assert life.state is State.WAITING
    assigned, _ = adm.pump(0.1)
    assert assigned == []  # the decode instance has room, but it does not prefill
    busy.close()
    assigned, _ = adm.pump(0.2)
    assert [w.instance for w in assigned] == ["p0"]
