#!/usr/bin/env python3
"""cache_aware's tuning knobs, measured in the simulator (everything else at its default):

  * the miss weights α (cost = queued prefill + α x uncached tokens; α = 1 is the greedy estimate of this
    request's own TTFT): `miss_weight` for a prefix only one instance holds (a private one: a conversation),
    `shared_miss_weight` for one several instances hold (or none), and
  * the bounded-load guard: no instance above (1 + ε) x mean in-flight + slack.

    .venv/bin/python benchmarks/cache_aware_tuning.py
"""

from __future__ import annotations

from dataclasses import replace

from warmroute.core.strategies import StrategySettings, merge_layers
from warmroute.sim.report import summarize
from warmroute.sim.simulator import Simulation, SimSettings
from warmroute.workloads.registry import make_workload

CASES = [
    ("mixed, 12 req/s", "mixed", SimSettings(instances=4, requests=3000, rate=12, kv_capacity_tokens=30_000,
                                             max_running=32), {}),
    ("hot, 32 req/s", "hot", SimSettings(instances=4, requests=4000, rate=32, kv_capacity_tokens=30_000,
                                         max_running=32), {}),
    ("chat, 32 clients, 4 small caches", "chat", SimSettings(instances=4, requests=3000, concurrency=32,
                                                           kv_capacity_tokens=13_312, max_running=8),
     dict(min_turns=6, max_turns=12, reply_tokens=300, max_tokens=2)),
    ("hot, 16 clients, 4 small caches", "hot", SimSettings(instances=4, requests=2000, concurrency=16,
                                                         kv_capacity_tokens=10_240, max_running=8),
     dict(hot=0.6, max_tokens=2)),
    ("70B, 24k-token prefixes, 29 of them, 64 clients", "shared",
     SimSettings(instances=7, profile="70b", max_running=256, requests=1500, concurrency=64,
                 routing=StrategySettings(concurrency_threshold=64)),
     dict(pool_size=29, system_tokens=24576, question_tokens=256, zipf=0.0, max_tokens=128)),
]


VARIANTS = [("α", dict(miss_weight=p, shared_miss_weight=q)) for p, q in ((1.0, 1.0), (2.0, 2.0), (4.0, 4.0),
                                                                          (16.0, 2.0), (8.0, 1.0), (16.0, 1.0))] + [
    ("guard", dict(balance_factor=e, balance_slack=k)) for e, k in ((0.25, 2), (1.0, 4), (10.0, 64))]


def main() -> None:
    print(f"{'case':<50} {'setting':<44} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>6} {'spread':>6}")
    for label, workload, settings, params in CASES:
        for _, change in VARIANTS:
            changed = replace(settings, routing=StrategySettings(**merge_layers(settings.routing.model_dump(), change)))
            sim = Simulation(changed, make_workload(workload, seed=0, **params), "cache_aware")
            s = summarize(sim.run())
            setting = ", ".join(f"{k}={v:g}" for k, v in change.items())
            print(f"{label:<50} {setting:<44} {s.hit_rate:>8.1%} {s.ttft_p50_ms:>7.0f}ms {s.ttft_p99_ms:>7.0f}ms "
                  f"{s.throughput_rps:>6.2f} {s.load_spread:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
