#!/usr/bin/env python3
"""Autoscaling in the simulator (issue #23): the demand signal against busy-time utilisation, cache-aware
scale-in against arbitrary, over a ramp-and-burst workload and the Mooncake conversation trace at changing speed.

For each workload, each signal is swept over its target (scale-in cache_aware), and each signal's cheapest
target whose TTFT p99 meets the SLO in >= 95% of the windows is its operating point: the same SLO attainment
bar for both, each at its best cost (a signal none of whose targets reaches it is reported so, with its best
attainment). Then the demand signal's operating point is run with arbitrary (random) and newest-first scale-in:
the hit rate lost in the minute after each scale-in, against cache_aware's. The autoscaled runs scale in at
different moments under different loads (their before/after difference is mostly the load changing), so the
scale-in policies are also compared on equal terms: a steady load, one scale-in at a given moment, and the hit
rate of the minute after it against the same minute of the same run without it (`--scale-in-only`).

    .venv/bin/python benchmarks/autoscale.py [--workloads ramp-burst,mooncake] [--trace FILE]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from warmroute.sim.autoscale import ARBITRARY, CACHE_AWARE, DEMAND, NEWEST, UTILIZATION, AutoscaleSettings
from warmroute.sim.report import (HIT_LOSS_WINDOW_S, AutoscaleSummary, autoscale_summary, autoscale_table,
                                  slo_text)
from warmroute.sim.simulator import SimResult, Simulation, SimSettings
from warmroute.workloads.base import Workload
from warmroute.workloads.rate_shape import RateShape, ramp_and_burst
from warmroute.workloads.registry import make_workload

TRACE = "../shared/data/mooncake/conversation_trace.jsonl"  # from the repository root, as the other docs
UTILIZATION_TARGETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
DEMAND_TARGETS = (0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7)
ATTAINMENT = 0.95  # the acceptance's bar: the SLO met in at least this share of the windows


@dataclass
class Case:
    label: str
    workload: Workload
    settings: SimSettings
    slo: dict = field(default_factory=dict)
    steady_instances: int = 8  # the fleet the scale-in comparison starts from


def case(name: str, trace: str, seed: int = 1) -> Case:
    shape = ramp_and_burst()
    if name == "ramp-burst":
        return Case("mixed workload, 128 output tokens, 12 sessions/s at peak x ramp-burst (x2 burst)",
                    make_workload("mixed", seed=seed, max_tokens=128),
                    SimSettings(instances=2, requests=10**9, rate=12.0, rate_shape=shape, seed=seed),
                    slo=dict(slo_ttft_s=1.0))
    if name == "mooncake":
        return Case("Mooncake conversation trace, x1 speed at peak x ramp-burst (x2 burst)",
                    make_workload("trace", seed=seed, path=trace),
                    SimSettings(instances=6, requests=10**9, speedup=1.0, rate_shape=shape, seed=seed),
                    slo=dict(slo_ttft_s=10.0, slo_tokens_per_s=4000.0), steady_instances=16)
    raise SystemExit(f"unknown workload {name!r}: ramp-burst or mooncake")


STEADY_SCALE_INS = (300.0, 360.0, 420.0, 480.0)


def steady(c: Case, policy: str, scale_in_at: float | None) -> SimResult:
    """The case's workload at its peak rate, steady for 10 minutes, on `steady_instances` instances, one of
    which is drained at `scale_in_at` (None: never)."""
    a = AutoscaleSettings(scale_in=policy, **c.slo)
    settings = SimSettings(**{**c.settings.__dict__, "autoscale": a, "instances": c.steady_instances,
                              "rate_shape": RateShape(((0.0, 1.0), (600.0, 0.0))),
                              "scale_events": [(scale_in_at, -1)] if scale_in_at is not None else []})
    return Simulation(settings, c.workload, "cache_aware").run()


def minute_hit_rate(r: SimResult, t: float) -> float:
    xs = [x for x in r.records if x.first_token is not None and t <= x.first_token < t + HIT_LOSS_WINDOW_S]
    return sum(x.cached_tokens for x in xs) / max(1, sum(x.prompt_tokens for x in xs))


def scale_in_comparison(c: Case) -> None:
    """Each policy drains one instance at one moment (a run per moment); the hit rate lost is that of the minute
    after it against the same minute of a run with no scale-in: the same requests, only the drain differs."""
    print(f"scale-in policies: {c.steady_instances} instances at the peak rate, steady; one scale-in at "
          f"{', '.join(f'{t:.0f}' for t in STEADY_SCALE_INS)} s (a run each): hit rate of the minute after it, "
          "against the same minute without it")
    base = steady(c, NEWEST, None)
    for policy in (CACHE_AWARE, ARBITRARY, NEWEST):
        runs = [steady(c, policy, t) for t in STEADY_SCALE_INS]
        losses = [minute_hit_rate(base, t) - minute_hit_rate(r, t) for r, t in zip(runs, STEADY_SCALE_INS)]
        values = ", ".join("-" if r.scale_ins[0].unique_value is None else f"{r.scale_ins[0].unique_value:.0f}"
                           for r in runs)
        print(f"  {policy:<12} lost {sum(losses) / len(losses) * 100:+.2f}pp on average (each: "
              f"{', '.join(f'{x * 100:+.2f}' for x in losses)}); the victims' cached tokens no other instance "
              f"held, per request: {values}", flush=True)


def run(case: Case, signal: str, target: float, scale_in: str) -> AutoscaleSummary:
    a = AutoscaleSettings(autoscale=signal, scale_target=target, scale_in=scale_in, min_instances=2,
                          max_instances=64, **case.slo)
    settings = SimSettings(**{**case.settings.__dict__, "autoscale": a})
    summary = autoscale_summary(Simulation(settings, case.workload, "cache_aware").run())
    assert summary is not None
    return summary


def operating_point(sweep: list[AutoscaleSummary]) -> AutoscaleSummary | None:
    """The cheapest run of a sweep that met the SLO in at least ATTAINMENT of its windows."""
    met = [r for r in sweep if (r.slo_attainment or 0.0) >= ATTAINMENT]
    return min(met, key=lambda r: r.instance_seconds) if met else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="ramp-burst,mooncake")
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--utilization-targets", default=",".join(map(str, UTILIZATION_TARGETS)))
    parser.add_argument("--demand-targets", default=",".join(map(str, DEMAND_TARGETS)))
    parser.add_argument("--seed", type=int, default=1, help="workload and arrival seed")
    parser.add_argument("--scale-in-only", action="store_true", help="only the scale-in policies, steady load")
    args = parser.parse_args()
    sweeps = {DEMAND: [float(t) for t in args.demand_targets.split(",")],
              UTILIZATION: [float(t) for t in args.utilization_targets.split(",")]}
    for name in args.workloads.split(","):
        c, started = case(name, args.trace, args.seed), time.perf_counter()
        print(f"== {name}: {c.label}", flush=True)
        if args.scale_in_only:
            scale_in_comparison(c)
            continue
        runs = {signal: [run(c, signal, t, CACHE_AWARE) for t in targets] for signal, targets in sweeps.items()}
        points = {signal: operating_point(sweep) for signal, sweep in runs.items()}
        best_demand = points[DEMAND] or max(runs[DEMAND], key=lambda r: r.slo_attainment or 0.0)
        others = [run(c, DEMAND, best_demand.target, policy) for policy in (ARBITRARY, NEWEST)]
        print(autoscale_table([*runs[DEMAND], *runs[UTILIZATION], *others], slo_text(AutoscaleSettings(**c.slo))))
        for signal, point in points.items():
            print(f"{signal}: " + (f"cheapest target meeting the SLO in >= {ATTAINMENT:.0%} of windows: "
                                   f"{point.target:.2f}, {point.instance_seconds:.0f} instance-seconds"
                                   if point else f"no target met the SLO in {ATTAINMENT:.0%} of windows (best "
                                   f"{max(r.slo_attainment or 0.0 for r in runs[signal]):.0%})"))
        if points[DEMAND] and points[UTILIZATION]:
            ratio = points[DEMAND].instance_seconds / points[UTILIZATION].instance_seconds
            print(f"demand / utilization instance-seconds at the same SLO attainment: {ratio:.2f}x")
        arbitrary = others[0]
        if best_demand.hit_rate_lost is not None and arbitrary.hit_rate_lost is not None:
            print(f"hit rate lost in the minute after a scale-in (demand {best_demand.target:.2f}): cache_aware "
                  f"{best_demand.hit_rate_lost:+.2%}, arbitrary {arbitrary.hit_rate_lost:+.2%}, newest "
                  f"{fmt_loss(others[1])}")
        scale_in_comparison(c)
        print(f"({time.perf_counter() - started:.0f} s)\n", flush=True)


def fmt_loss(r: AutoscaleSummary) -> str:
    return "-" if r.hit_rate_lost is None else f"{r.hit_rate_lost:+.2%}"


if __name__ == "__main__":
    main()
