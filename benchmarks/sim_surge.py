#!/usr/bin/env python3
"""The 2x surge of overload.py in the simulator (virtual time, no machine noise): four engines batching 256, Poisson
sessions of the mixed workload at --mult x the capacity for 60 s, then 0.5x for 60 s; goodput = requests arriving in
[5 s, 60 s) answered within the 2-s TTFT SLO.

    .venv/bin/python benchmarks/sim_surge.py --mult 2 --capacity 74.4 --seed 0 [--strategy sglang_like --no-admission]
        [--set shared_miss_weight=16] [--set 'queue={"lifo_after_s": 0}'] [--set queue_timeout_s=60]
"""

from __future__ import annotations

import argparse
import json

from warmroute.bench.stats import percentile
from warmroute.sim.simulator import SimSettings, Simulation
from warmroute.workloads import make_workload
from warmroute.workloads.rate_shape import RateShape
from warmroute.workloads.tenants import turns_per_session

SLO_S, HIGH_S, LOW_S, WARMUP_S = 2.0, 60.0, 60.0, 5.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mult", type=float, default=2.0, help="the surge, in multiples of --capacity")
    p.add_argument("--capacity", type=float, default=74.4, help="requests/s (overload.py prints the one it measures)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="cache_aware")
    p.add_argument("--no-admission", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                   help="a SimSettings field or strategy setting (repeatable)")
    a = p.parse_args()
    workload = make_workload("mixed", seed=a.seed, max_tokens=16)
    shape = RateShape(((0.0, a.mult), (HIGH_S, 0.5), (HIGH_S + LOW_S, 0.0)))
    s = SimSettings(instances=4, max_running=256, rate=a.capacity / turns_per_session(workload), rate_shape=shape,
                    queue_timeout_s=SLO_S, admission=not a.no_admission, requests=10**7, seed=a.seed)
    for item in a.set:
        name, value = item.split("=", 1)
        s = s.changed(name, json.loads(value))
    r = Simulation(s, workload, a.strategy).run()
    window = [x for x in r.records if WARMUP_S <= x.arrival < HIGH_S]
    ttft = [x.first_token - x.arrival for x in window if x.first_token is not None]
    good = sum(t <= SLO_S for t in ttft) / (HIGH_S - WARMUP_S)
    refused = sum(WARMUP_S <= t < HIGH_S for t in r.rejected_at)
    print(f"{a.mult:g}x {a.strategy}{' no-admission' if a.no_admission else ''} {' '.join(a.set)}: goodput "
          f"{good:.1f} req/s, refused {refused}, TTFT p50 {1000 * (percentile(ttft, 50) or 0):.0f} ms, "
          f"p99 {1000 * (percentile(ttft, 99) or 0):.0f} ms, hit rate {r.hit_rate:.3f}")


if __name__ == "__main__":
    main()
