#!/usr/bin/env python3
"""Autoscaling in the simulator (issue #23): the demand signal against busy-time utilisation, cache-aware
scale-in against arbitrary, over a ramp-and-burst workload and the Mooncake conversation trace at changing speed.

For each workload:
  1. the demand signal at its target, scale-in cache_aware;
  2. utilisation-based scaling at every target of a sweep, scale-in cache_aware; the cheapest target whose SLO
     attainment is at least the demand run's is the fair baseline (the same SLO attainment, its best cost);
  3. the demand signal with arbitrary (random) and newest scale-in: the hit rate lost in the minute after each
     scale-in, against cache_aware's.

    .venv/bin/python benchmarks/autoscale.py [--workloads ramp-burst,mooncake] [--trace FILE]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from warmroute.sim.autoscale import ARBITRARY, CACHE_AWARE, DEMAND, NEWEST, UTILIZATION, AutoscaleSettings
from warmroute.sim.report import AutoscaleSummary, autoscale_summary, autoscale_table, slo_text
from warmroute.sim.simulator import Simulation, SimSettings
from warmroute.workloads.base import Workload
from warmroute.workloads.rate_shape import ramp_and_burst
from warmroute.workloads.registry import make_workload

TRACE = "../shared/data/mooncake/conversation_trace.jsonl"
UTILIZATION_TARGETS = (0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class Case:
    label: str
    workload: Workload
    settings: SimSettings
    demand_target: float
    slo: dict = field(default_factory=dict)


def cases(trace: str) -> dict[str, Case]:
    shape = ramp_and_burst()
    return {
        "ramp-burst": Case(
            "mixed workload, 128 output tokens, 12 sessions/s at peak x ramp-burst (x2 burst)",
            make_workload("mixed", seed=1, max_tokens=128),
            SimSettings(instances=2, requests=10**9, rate=12.0, rate_shape=shape, seed=1),
            demand_target=0.7, slo=dict(slo_ttft_s=1.0)),
        "mooncake": Case(
            "Mooncake conversation trace, x1 speed at peak x ramp-burst (x2 burst)",
            make_workload("trace", seed=1, path=trace),
            SimSettings(instances=6, requests=10**9, speedup=1.0, rate_shape=shape, seed=1),
            demand_target=0.7, slo=dict(slo_ttft_s=10.0, slo_tokens_per_s=4000.0)),
    }


def run(case: Case, signal: str, target: float, scale_in: str) -> AutoscaleSummary:
    a = AutoscaleSettings(autoscale=signal, scale_target=target, scale_in=scale_in, min_instances=2,
                          max_instances=64, **case.slo)
    settings = SimSettings(**{**case.settings.__dict__, "autoscale": a})
    summary = autoscale_summary(Simulation(settings, case.workload, "cache_aware").run())
    assert summary is not None
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="ramp-burst,mooncake")
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--utilization-targets", default=",".join(map(str, UTILIZATION_TARGETS)))
    args = parser.parse_args()
    all_cases = cases(args.trace)
    targets = [float(t) for t in args.utilization_targets.split(",")]
    for name in args.workloads.split(","):
        case, started = all_cases[name], time.perf_counter()
        demand = run(case, DEMAND, case.demand_target, CACHE_AWARE)
        sweep = [run(case, UTILIZATION, t, CACHE_AWARE) for t in targets]
        others = [run(case, DEMAND, case.demand_target, policy) for policy in (ARBITRARY, NEWEST)]
        a = AutoscaleSettings(**case.slo)
        print(f"== {name}: {case.label}")
        print(autoscale_table([demand, *sweep, *others], slo_text(a)))
        fair = [s for s in sweep if (s.slo_attainment or 0) >= (demand.slo_attainment or 0)]
        if fair:
            best = min(fair, key=lambda s: s.instance_seconds)
            print(f"utilization at the same SLO attainment: cheapest target {best.target:.2f} "
                  f"({best.slo_attainment:.0%}); demand uses {demand.instance_seconds / best.instance_seconds:.2f}x "
                  f"its instance-seconds")
        else:
            print("no utilization target in the sweep reached the demand run's SLO attainment")
        arbitrary = others[0]
        if demand.hit_rate_lost is not None and arbitrary.hit_rate_lost:
            print(f"hit rate lost in the minute after a scale-in: cache_aware {demand.hit_rate_lost:.2%} vs "
                  f"arbitrary {arbitrary.hit_rate_lost:.2%} ({demand.hit_rate_lost / arbitrary.hit_rate_lost:.2f}x)")
        print(f"({time.perf_counter() - started:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
