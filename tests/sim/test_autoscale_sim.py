"""The simulator's autoscaler (sim/autoscale.py) and rate shapes (workloads/rate_shape.py): behaviour, not timing."""

from __future__ import annotations

import functools
import math
import subprocess
import sys

import pytest

from warmroute.core.strategies import StrategySettings
from warmroute.errors import UsageError
from warmroute.sim.autoscale import AutoscaleSettings, Autoscaler
from warmroute.sim.report import autoscale_summary, hit_rate_lost, slo_windows
from warmroute.sim.simulator import RequestRecord, SimResult, SimSettings, Simulation
from warmroute.workloads.rate_shape import RateShape, parse_rate_shape, ramp_and_burst
from warmroute.workloads.registry import make_workload

BURST = RateShape(((0.0, 1.0), (60.0, 6.0), (120.0, 1.0), (240.0, 0.0)))  # a minute at 6x, then quiet, end


@functools.lru_cache(maxsize=None)  # each run once per test session
def burst_run(signal: str, scale_in: str = "cache_aware") -> SimResult:
    a = AutoscaleSettings(autoscale=signal, scale_target=0.6, min_instances=1, max_instances=6, interval_s=5,
                          reaction_delay_s=0, startup_s=10, scale_down_window_s=20, scale_in=scale_in)
    s = SimSettings(instances=1, requests=10**6, rate=4.0, rate_shape=BURST, autoscale=a, seed=3)
    return Simulation(s, make_workload("mixed", seed=3), "cache_aware").run()


@pytest.mark.parametrize("signal", ["demand", "utilization"])
def test_the_fleet_grows_in_the_burst_and_shrinks_after(signal):
    r = burst_run(signal)
    before = [p for t, _, p in r.fleet_sizes if t < 60]
    during = [p for t, _, p in r.fleet_sizes if 60 <= t < 130]
    after = [p for t, _, p in r.fleet_sizes if t >= 200]
    assert max(during) > max(before) and max(during) > 1
    assert after and after[-1] < max(during) and r.scale_ins
    assert all(x.done is not None for x in r.records) and r.rejected == 0
    # Paid for what it ran: more than one instance all along would cost, less than the peak all along.
    assert r.duration_s < r.instance_seconds < max(during) * r.duration_s
    summary = autoscale_summary(r)
    assert summary is not None and summary.signal == signal and summary.peak_instances == max(during)
    assert 0.0 <= (summary.slo_attainment or 0.0) <= 1.0 and summary.windows >= 4


def test_arrivals_follow_the_shape_and_stop_at_its_end():
    r = burst_run("demand")
    per_second = [sum(lo <= x.arrival < lo + 60 for x in r.records) / 60 for lo in (0, 60, 120)]
    assert per_second[1] > 3 * per_second[0] and per_second[1] > 3 * per_second[2]
    late = [x for x in r.records if x.arrival >= 240.0]  # no session starts after the end: only later turns
    assert len(late) < 0.02 * len(r.records) and all(x.tag == "chat" for x in late)


def test_cache_aware_scale_in_drains_the_instance_worth_least():
    """instance-2 alone holds most of a prefix asked for often, instance-1 one asked for once, instance-0 only
    what instance-2 holds too: cache_aware drains instance-0 (then instance-1), newest instance-2."""
    def fleet(policy: str) -> Simulation:
        a = AutoscaleSettings(autoscale="demand", scale_in=policy)
        sim = Simulation(SimSettings(instances=3, autoscale=a), make_workload("shared"), "cache_aware")
        hot, rare = list(range(1, 30)), list(range(100, 130))
        for name, chain in (("instance-2", hot), ("instance-1", rare), ("instance-0", hot[:10]),
                            ("instance-2", rare[:5])):
            sim.fleet.index.record(name, chain)
        for chain in [hot] * 5 + [rare]:
            sim.cache_value.requested(chain)
        return sim

    sim = fleet("cache_aware")
    victim, value = sim._victim(sim._live())
    assert victim.name == "instance-0" and value == 0.0
    sim._drain(0.0, victim, value)
    assert "instance-0" not in sim.fleet.instances and victim.draining
    assert sim._victim(sim._live())[0].name == "instance-1"  # of the two left, the one whose prefix is asked less
    newest = fleet("newest")
    assert newest._victim(newest._live())[0].name == "instance-2"
    arbitrary = [fleet("arbitrary") for _ in range(2)]
    assert len({sim._victim(sim._live())[0].name for sim in arbitrary}) == 1  # seeded: the same run, the same pick


def test_the_decision_scales_up_at_once_and_down_only_after_the_window():
    scaler = Autoscaler(AutoscaleSettings(autoscale="demand", scale_target=0.5, scale_down_window_s=60,
                                          max_instances=20))
    assert scaler.decide(0.0, 4, 4, 1.0) == 8  # up: at once
    assert scaler.decide(5.0, 8, 8, 5.0) == 16  # by at most double (or 4 more) per reading, as HPA's default
    assert scaler.decide(15.0, 8, 8, 0.1) == 8  # down: not while a higher count was asked within the window
    assert scaler.decide(70.0, 8, 8, 0.1) == 2  # the window has passed: down to what the signal asks
    assert scaler.decide(80.0, 0, 3, 0.0) == 3  # nothing ready to read: keep what is provisioned


def test_instance_seconds_count_start_up_and_drain():
    s = SimSettings(instances=2, requests=200, rate=4.0, scale_events=[(20.0, -1)], seed=1)
    r = Simulation(s, make_workload("shared", seed=1), "cache_aware").run()
    assert r.duration_s < r.instance_seconds < 2 * r.duration_s


def test_slo_windows_and_hit_rate_lost_from_records():
    recs = []
    for t in range(120):
        rec = RequestRecord(float(t), "i", 1000, "cache_hit", sent=float(t))
        late = 3.0 if 60 <= t < 62 else 0.1  # two slow requests in the second minute
        rec.first_token, rec.done = t + late, t + late + 1
        rec.cached_tokens = 800 if t < 60 else 200
        recs.append(rec)
    a = AutoscaleSettings(autoscale="demand", slo_ttft_s=1.0, slo_window_s=60.0)
    r = SimResult("cache_aware", recs, 125.0, {"i": 120}, 0, 0, autoscale=a, rejected_at=[5.0])
    assert slo_windows(r) == [False, False]  # a refused request misses; 2 of 60 over 1 s pass the p99
    r.rejected_at = []
    assert slo_windows(r) == [True, False]
    allowed = AutoscaleSettings(autoscale="demand", slo_ttft_s=1.0, slo_tokens_per_s=400.0)
    assert slo_windows(SimResult("x", recs, 125.0, {}, 0, 0, autoscale=allowed)) == [True, True]  # +2.5 s each
    assert hit_rate_lost(r, 60.0) == pytest.approx(0.6, abs=0.02)


def test_rate_shapes():
    shape = RateShape(((0.0, 1.0), (10.0, 2.0), (20.0, 0.0)))
    assert shape.time_of(5.0) == 5.0 and shape.time_of(20.0) == 15.0  # twice as fast from 10 s
    assert shape.time_of(30.0) == math.inf and shape.end_s == 20.0 and shape.multiplier(12.0) == 2.0
    rb = ramp_and_burst()
    assert max(m for _, m in rb.steps) == 2.0 and rb.steps[0][1] == rb.steps[-2][1] and rb.end_s is not None
    assert parse_rate_shape("ramp-burst") == rb and parse_rate_shape("0:1,5:2").steps == ((0.0, 1.0), (5.0, 2.0))
    for bad in ("1:1", "0:1,5:-1", "0:1,0:2", "x", "0:0"):
        with pytest.raises(UsageError):
            parse_rate_shape(bad)


def test_cli_autoscale_flags_and_errors():
    run = [sys.executable, "-m", "warmroute", "simulate", "--strategies", "cache_aware"]
    ok = subprocess.run(run + ["--workload", "shared", "--rate", "4", "--rate-shape", "0:1,30:4,60:1,90:0",
                               "--autoscale", "demand", "--min", "1", "--max", "4", "--target", "0.6",
                               "--instances", "1", "--interval-s", "5", "--startup-s", "5", "--scale-in",
                               "cache_aware", "--slo-ttft-s", "0.5", "--requests", "100000"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "SLO: TTFT p99 <= 0.5 s" in ok.stdout and "demand" in ok.stdout
    for argv, says in ((["--autoscale", "gpu"], "--autoscale gpu"), (["--min", "5", "--max", "3"], "above"),
                       (["--rate-shape", "0:1", "--concurrency", "4"], "--rate-shape"),
                       (["--scale-in", "oldest"], "--scale-in oldest")):
        bad = subprocess.run(run + argv, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and says in bad.stderr and "Traceback" not in bad.stderr


@functools.lru_cache(maxsize=None)
def join_run(slow_start_window: float) -> SimResult:
    """Three instances serve a hot prompt's traffic; a fourth joins at 60 s."""
    s = SimSettings(instances=3, requests=10**6, rate=12.0, rate_shape=RateShape(((0.0, 1.0), (140.0, 0.0))),
                    scale_events=[(60.0, +1)], routing=StrategySettings(slow_start_window=slow_start_window),
                    seed=2)
    return Simulation(s, make_workload("hot", seed=2), "cache_aware").run()


def new_share(r: SimResult, lo: float, hi: float) -> float:
    sent = [x for x in r.records if lo <= x.sent < hi]
    return sum(x.instance == "instance-3" for x in sent) / len(sent)


def test_an_instance_that_joins_ramps_up_with_slow_start():
    """With a 60-s slow start the new instance's share grows over the window (a hot prefix copied to it first)
    and stays under what it takes at once without; without, it takes its share at once."""
    ramped, at_once = join_run(60.0), join_run(0.0)
    shares = [new_share(ramped, t, t + 20) for t in (60, 80, 100)]
    assert shares == sorted(shares) and 0 < shares[0] < new_share(at_once, 60, 80)
    assert any(x.reason == "slow_start" and x.instance == "instance-3" for x in ramped.records)
    assert not any(x.reason == "slow_start" for x in at_once.records)
