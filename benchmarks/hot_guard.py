#!/usr/bin/env python3
"""cache_aware's guard for hot prefixes, on and off, in the simulator: request spread (busiest instance's
requests / mean), hit rate, TTFT, over several seeds.

    .venv/bin/python benchmarks/hot_guard.py [--seeds 6]

Cases: the peer comparison's fleet (4 instances of 10,240 KV tokens, 8 running each) with the hot workload
(one prompt on 60% of requests) at fixed rates and as a closed loop of 16 clients, plus the chat and mixed
workloads of benchmarks/cache_aware_tuning.py (where no prefix is hot, so the guard must change nothing).
"""

from __future__ import annotations

import argparse
import statistics

from warmroute.sim.report import summarize
from warmroute.sim.simulator import SimSettings, Simulation
from warmroute.workloads.registry import make_workload

HOT = dict(hot=0.6, max_tokens=2)
CASES = [
    ("hot, 20 req/s", "hot", dict(requests=3000, rate=20.0, kv_capacity_tokens=10240, max_running=8), HOT),
    ("hot, 25 req/s", "hot", dict(requests=3000, rate=25.0, kv_capacity_tokens=10240, max_running=8), HOT),
    ("hot, 30 req/s", "hot", dict(requests=3000, rate=30.0, kv_capacity_tokens=10240, max_running=8), HOT),
    ("hot, 16 clients", "hot", dict(requests=2000, concurrency=16, kv_capacity_tokens=10240, max_running=8), HOT),
    ("chat, 32 clients", "chat", dict(requests=3000, concurrency=32, kv_capacity_tokens=13312, max_running=8),
     dict(min_turns=6, max_turns=12, reply_tokens=300, max_tokens=2)),
    ("mixed, 12 req/s", "mixed", dict(requests=3000, rate=12.0, kv_capacity_tokens=30000, max_running=32), {}),
]
VARIANTS = [("off", 1000.0), ("on (δ 0.2)", 0.2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args()
    print(f"{'case':<18} {'guard':<11} {'spread':>6} {'(min-max)':>11} {'hit rate':>8} {'TTFT p50':>8} "
          f"{'TTFT p99':>8} {'hot p50':>7} {'req/s':>6}")
    for label, workload, sim, params in CASES:
        for name, factor in VARIANTS:
            rows = []
            for seed in range(args.seeds):
                s = Simulation(SimSettings(instances=4, seed=seed, **sim).changed("hot_balance_factor", factor),
                               make_workload(workload, seed=seed, **params), "cache_aware")
                rows.append(summarize(s.run()))
            mean = lambda f: statistics.mean(f(r) for r in rows)  # noqa: E731
            spreads = [r.load_spread for r in rows]
            hot = [r.ttft_p50_ms_by_class.get("hot") for r in rows if r.ttft_p50_ms_by_class.get("hot")]
            print(f"{label:<18} {name:<11} {mean(lambda r: r.load_spread):6.2f} "
                  f"{f'{min(spreads):.2f}-{max(spreads):.2f}':>11} {mean(lambda r: r.hit_rate):8.1%} "
                  f"{mean(lambda r: r.ttft_p50_ms):6.0f}ms {mean(lambda r: r.ttft_p99_ms):6.0f}ms "
                  f"{(f'{statistics.mean(hot):5.1f}ms' if hot else '-'):>7} {mean(lambda r: r.throughput_rps):6.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
