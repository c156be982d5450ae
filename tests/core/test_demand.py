"""The demand signal (core/demand.py): fleet utilisation of genuine capacity, the HPA formula, the estimators."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st
from pydantic import ValidationError

from warmroute.core.demand import (DECODE, KV, PREFILL, DemandMeter, DemandSettings, FleetDemand, InstanceDemand,
                                   PrefillRate, TokenRate, desired_for, desired_instances, fleet_demand)
from warmroute.core.fleet import Fleet
from warmroute.core.slow_start import slow_start_weight


def test_fleet_demand_is_summed_demand_over_summed_capacity_per_dimension():
    a = InstanceDemand(uncached_tokens_per_s=3000, prefill_tokens_per_s=4000, inflight=8, max_inflight=32,
                       kv_demand_tokens=100_000, kv_capacity_tokens=400_000)
    b = InstanceDemand(uncached_tokens_per_s=1000, prefill_tokens_per_s=4000, inflight=4, max_inflight=32,
                       kv_demand_tokens=50_000, kv_capacity_tokens=400_000)
    d = fleet_demand([a, b])
    assert d.prefill == pytest.approx(0.5) and d.decode == pytest.approx(12 / 64)
    assert d.kv == pytest.approx(150_000 / 800_000)
    assert d.ratio == pytest.approx(0.5) and d.bottleneck == PREFILL


def test_backlog_counts_as_demand_over_the_horizon():
    idle_but_behind = InstanceDemand(uncached_tokens_per_s=0, prefill_tokens_per_s=1000, backlog_tokens=60_000)
    assert fleet_demand([idle_but_behind], backlog_horizon_s=30).prefill == pytest.approx(2.0)
    assert fleet_demand([idle_but_behind], backlog_horizon_s=60).prefill == pytest.approx(1.0)


def test_the_bottleneck_is_the_most_used_dimension():
    decode_bound = InstanceDemand(100, 4000, inflight=30, max_inflight=32)
    assert fleet_demand([decode_bound]).bottleneck == DECODE
    kv_bound = InstanceDemand(100, 4000, kv_demand_tokens=390, kv_capacity_tokens=400)
    assert fleet_demand([kv_bound]).bottleneck == KV
    assert fleet_demand([]).ratio == 0.0  # no instance: no utilisation, not a division by zero


def test_desired_instances_is_the_hpa_formula_with_tolerance_and_bounds():
    assert desired_instances(4, 1.4, 0.7) == 8
    assert desired_instances(4, 0.35, 0.7) == 2
    assert desired_instances(4, 0.75, 0.7) == 4  # within 10% of the target: no change
    assert desired_instances(4, 0.8, 0.7) == 5  # 14% above: ceil(4 * 1.143)
    assert desired_instances(4, 0.0, 0.7, min_instances=2) == 2
    assert desired_instances(4, 10.0, 0.7, max_instances=12) == 12
    assert desired_instances(0, 1.0, 0.7, min_instances=3) == 3
    s = DemandSettings(scale_target=0.5, min_instances=2, max_instances=6, scale_tolerance=0.0)
    assert desired_for(3, 0.5, s) == 3 and desired_for(3, 0.6, s) == 4 and desired_for(3, 0.01, s) == 2


@given(st.integers(1, 200), st.floats(0, 20), st.floats(0.05, 1.0), st.integers(1, 50), st.integers(1, 300))
def test_desired_instances_stays_within_bounds_and_moves_toward_the_target(current, util, target, low, high):
    n = desired_instances(current, util, target, low, high)
    assert low <= n <= max(low, high)
    if low <= current <= high:
        if util > target * 1.1:
            assert n >= current
        if util < target * 0.9:
            assert n <= current


def test_settings_are_validated():
    with pytest.raises(ValidationError):
        DemandSettings(scale_target=0.0)
    with pytest.raises(ValidationError):
        DemandSettings(min_instances=0)
    with pytest.raises(ValidationError, match="above max_instances"):
        DemandSettings(min_instances=5, max_instances=4)


def test_prefill_rate_learns_the_rate_and_forgets_the_prior():
    rate = PrefillRate(prior_tokens_per_s=10_000, window=16)
    assert rate.value == pytest.approx(10_000)
    for _ in range(200):
        rate.observe(4000, 1.0)  # the instance really does 4,000 tokens/s
    assert rate.value == pytest.approx(4000, rel=0.01)
    rate.observe(-1, 1.0)
    rate.observe(100, 0.0)  # nonsense observations change nothing
    rate.observe(math.nan, 1.0)
    assert rate.value == pytest.approx(4000, rel=0.01) and rate.observations == 200


def test_prefill_rate_weighs_observations_by_their_length():
    rate = PrefillRate(prior_tokens_per_s=1000, window=1000, prior_s=1e-9)
    rate.observe(10_000, 2.0)  # 5,000 tokens/s on a long prompt
    rate.observe(10, 0.1)  # a short prompt's fixed overhead: 100 tokens/s
    assert rate.value == pytest.approx(10_010 / 2.1, rel=0.01)


def test_token_rate_measures_a_steady_rate_and_fades_after_it_stops():
    meter = TokenRate(tau_s=10.0, start=0.0)
    for t in range(1, 101):
        meter.add(float(t), 500.0)
    assert meter.rate(100.0) == pytest.approx(500.0, rel=0.06)
    young = TokenRate(tau_s=10.0, start=0.0)
    for t in range(1, 4):
        young.add(float(t), 500.0)
    # Three seconds' worth over a full window: it errs low (an autoscaler acts at once on a reading that is high)
    assert young.rate(3.0) == pytest.approx(1500.0 / (10.0 * (1 - math.exp(-1))), rel=0.1)
    assert young.rate(3.0) < 500.0
    assert meter.rate(150.0) < 0.01 * 500.0


def test_demand_meter_reads_the_fleet_books():
    fleet = Fleet()
    inst = fleet.add("a", kv_capacity_tokens=100_000, prefill_tokens_per_s=2000)
    meter = DemandMeter(tau_s=10.0)
    for t in range(0, 60):
        fleet.dispatched("a", 1000, prompt_tokens=1500)
        meter.dispatched(inst, float(t), 1000)
        meter.first_token(inst, float(t) + 0.5, 1000, 0.5)
        fleet.first_token("a", 1000)
        fleet.finished("a", prompt_tokens=1500)
    fleet.dispatched("a", 3000, prompt_tokens=5000)  # one still waiting for its first token
    d = meter.instance_demand(inst, 60.0, max_inflight=32, waiting=2, waiting_tokens=600)
    assert d.uncached_tokens_per_s == pytest.approx(1000, rel=0.1)
    assert d.prefill_tokens_per_s == pytest.approx(2000, rel=0.05)
    assert d.backlog_tokens == 600 and d.inflight == 3 and d.kv_demand_tokens == 5000
    meter.forget("a")
    assert "a" not in meter.routed


def test_slow_start_ramps_from_the_floor_to_full_weight():
    assert slow_start_weight(0.0, 60.0) == pytest.approx(0.1)
    assert slow_start_weight(30.0, 60.0) == pytest.approx(0.5)
    assert slow_start_weight(30.0, 60.0, aggression=2.0) == pytest.approx(math.sqrt(0.5))
    assert slow_start_weight(60.0, 60.0) == 1.0 and slow_start_weight(5.0, 0.0) == 1.0
    weights = [slow_start_weight(t, 60.0, aggression=0.5) for t in range(0, 61, 5)]
    assert weights == sorted(weights) and weights[-1] == 1.0


def _replica(routes: list[tuple[float, str, int]], now: float) -> FleetDemand:
    """One router replica's figures after routing `routes` (time, instance, uncached tokens), all still in flight."""
    fleet, meter = Fleet(), DemandMeter(tau_s=10.0)
    for name in ("a", "b"):
        fleet.add(name, kv_capacity_tokens=100_000, prefill_tokens_per_s=1000)
    for t, name, tokens in routes:
        fleet.dispatched(name, tokens)
        meter.dispatched(fleet.instances[name], t, tokens)
    return fleet_demand([meter.instance_demand(i, now, max_inflight=4) for i in fleet.instances.values()])


def test_replicas_dimensions_add_up_to_the_fleets_but_their_ratios_do_not():
    long_cold = [(0.0, "a", 20_000), (1.0, "b", 20_000)]  # prefill-bound
    many_short = [(float(t), "ab"[t % 2], 0) for t in range(6)]  # concurrency-bound
    one, two, together = _replica(long_cold, 6.0), _replica(many_short, 6.0), _replica(long_cold + many_short, 6.0)
    assert one.bottleneck == PREFILL and two.bottleneck == DECODE
    summed = {d: one.dimensions()[d] + two.dimensions()[d] for d in (PREFILL, DECODE, KV)}
    assert summed == pytest.approx(together.dimensions())  # what warmroute_fleet_utilization's sum() gives
    assert max(summed.values()) == pytest.approx(together.ratio)
    # The sum of the replicas' ratios adds one replica's prefill to the other's concurrency: more than the fleet's
    assert one.ratio + two.ratio > together.ratio * 1.1


def test_a_new_instance_rate_counts_from_the_meters_start_not_its_own():
    fleet, meter = Fleet(), DemandMeter(tau_s=60.0)
    old = fleet.add("old", kv_capacity_tokens=100_000, prefill_tokens_per_s=1000)
    for t in range(600):
        meter.dispatched(old, float(t), 100)  # 100 tokens/s for ten minutes
    new = fleet.add("new", kv_capacity_tokens=100_000, prefill_tokens_per_s=1000)
    for t in range(600, 610):
        meter.dispatched(new, float(t), 100)  # half of it moves to the new instance
        meter.dispatched(old, float(t), 100)
    at = 610.0
    total = sum(meter.instance_demand(i, at, 4).uncached_tokens_per_s for i in (old, new))
    # Its ten seconds of traffic are not extrapolated to a rate of their own: the fleet's stays near its level
    # (the two ten-second halves weigh as ten seconds of the fleet's 200 tokens/s would)
    assert meter.instance_demand(new, at, 4).uncached_tokens_per_s == pytest.approx(1000 / 60, rel=0.15)
    assert total == pytest.approx(100 + 1000 / 60, rel=0.1)
