#!/usr/bin/env python3
"""Routing decision latency of the pure core: 64 instances, 100,000 indexed prefixes, 32,000-character prompts.

    .venv/bin/python benchmarks/decision_latency.py [--instances 64] [--prefixes 100000] [--chars 32000]

Times, per request: building the routing key from the parsed body, hashing its blocks, the strategy's choice
(index lookups + cost), and recording the chosen instance's blocks in the index. Prints p50/p99 in µs for a
warm prompt (its prefix is indexed) and a cold one, for cache_aware and prefix, measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.routing_key import key_for_json
from warmroute.core.strategies import make_strategy


def words(rng: random.Random, n_chars: int) -> str:
    vocab = ["cache", "router", "prefix", "token", "block", "fleet", "engine", "model", "latency", "policy"]
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(vocab)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def body(system: str, user: str) -> dict:
    return {"model": "llama", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=1000)[int(q * 10) - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--prefixes", type=int, default=100_000)
    ap.add_argument("--chars", type=int, default=32_000)
    ap.add_argument("--samples", type=int, default=2_000)
    args = ap.parse_args()
    rng = random.Random(0)

    fleet = Fleet(FleetSettings())
    for i in range(args.instances):
        fleet.add(f"instance-{i}", kv_capacity_tokens=10**8)
    t0 = time.perf_counter()
    for p in range(args.prefixes):  # 100k distinct ~600-character prompts spread over the fleet
        k = key_for_json("/v1/chat/completions", body(f"tenant {p} " + words(rng, 600), "hi"))
        fleet.index.record(f"instance-{p % args.instances}", k.blocks())
    print(f"indexed {args.prefixes:,} prefixes ({fleet.index.entries():,} block entries, "
          f"≈{fleet.index.estimated_bytes() / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s")

    long_system = words(rng, args.chars - 200)
    warm_key = key_for_json("/v1/chat/completions", body(long_system, "warm-up"))
    fleet.index.record("instance-7", warm_key.blocks())

    print(f"{'strategy':<12} {'prompt':<5} {'stage':<22} {'p50 µs':>8} {'p99 µs':>8}")
    for name in ("cache_aware", "prefix"):
        strategy = make_strategy(name)
        for label in ("warm", "cold"):
            stages: dict[str, list[float]] = {"key (parse to bytes)": [], "block hashes": [], "choose": [],
                                              "record in index": [], "total": []}
            for n in range(args.samples):
                system = long_system if label == "warm" else f"{n} " + long_system
                b = body(system, f"question {n} " + words(rng, 150))
                t0 = time.perf_counter_ns()
                key = key_for_json("/v1/chat/completions", b)
                t1 = time.perf_counter_ns()
                key.blocks()
                t2 = time.perf_counter_ns()
                d = strategy.choose(key, fleet)
                t3 = time.perf_counter_ns()
                if strategy.records_prefixes:
                    fleet.index.record(d.instance, d.blocks)
                t4 = time.perf_counter_ns()
                for stage, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                    stages[stage].append(dt / 1000)
            for stage, xs in stages.items():
                print(f"{name:<12} {label:<5} {stage:<22} {pct(xs, 50):8.1f} {pct(xs, 99):8.1f}")


if __name__ == "__main__":
    main()
