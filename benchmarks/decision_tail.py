#!/usr/bin/env python3
"""What the slowest cache_aware decisions have in common: garbage collections, page faults, context switches.

    .venv/bin/python benchmarks/decision_tail.py [--samples 3000]

Runs decision_latency.py's setup and requests (warmroute.bench.decision_setup: 64 instances, 100,000 prefixes,
32,000-character prompts; key + block hashes + choose timed, the record untimed) and notes, per decision, whether a
collection ran inside it (gc.callbacks), and its page faults and context switches (getrusage, read outside the timed
part). Prints, for a warm and a cold prompt, the p50 / p99, how many decisions had each, how many of the slowest 1%
did, and the p99 without them. Then the same pure-Python work as the noise-floor row at four lengths: how many of its
samples pass 50 µs, which shows how often this machine interrupts work that never varies, as a function of its
length.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import time

from warmroute.bench import decision_setup as dl
from warmroute.core.routing_key import key_for_json

LENGTHS_US = (8, 12, 18, 25)


def traced(core: dl.Core, strategy, fleet, raws: list[bytes]) -> list[tuple[float, bool, int, int]]:
    """Per decision: µs, a collection inside, page faults, context switches."""
    starts: list[int] = []
    spans: list[tuple[int, int]] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(time.perf_counter_ns())

    gc.callbacks.append(on_gc)
    rows = []
    try:
        for raw in raws:
            b = json.loads(raw)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter_ns()
            key = key_for_json("/v1/chat/completions", b)
            core.blocks(key)
            d = strategy.choose(key, fleet)
            t1 = time.perf_counter_ns()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            fleet.index.record(d.instance, d.blocks)
            spans.append((t0, t1))
            switches = r1.ru_nvcsw - r0.ru_nvcsw + r1.ru_nivcsw - r0.ru_nivcsw
            rows.append([(t1 - t0) / 1000, False, r1.ru_minflt - r0.ru_minflt, switches])
    finally:
        gc.callbacks.remove(on_gc)
    for t in starts:
        for row, (t0, t1) in zip(rows, spans):
            if t0 <= t <= t1:
                row[1] = True
    return [tuple(r) for r in rows]


def report(label: str, rows: list[tuple[float, bool, int, int]]) -> None:
    times = [r[0] for r in rows]
    p99 = dl.pct(times, 99)
    slow = [r for r in rows if r[0] >= p99]
    clean = [r[0] for r in rows if not r[1] and not r[2] and not r[3]]
    count = lambda rs, k: sum(1 for r in rs if r[k])  # noqa: E731
    print(f"{label}: p50 {dl.pct(times, 50):.1f} p99 {p99:.1f} µs | with a collection / page fault / context switch: "
          f"all {count(rows, 1)} / {count(rows, 2)} / {count(rows, 3)} of {len(rows)}, slowest 1% {count(slow, 1)} / "
          f"{count(slow, 2)} / {count(slow, 3)} of {len(slow)} | p99 of those with none: {dl.pct(clean, 99):.1f} µs")


def interruptions(samples: int) -> None:
    for target in LENGTHS_US:
        n = dl.work_steps(target)
        times = [dl.timed_work(n) for _ in range(samples)]
        print(f"fixed work {target:>2} µs: p50 {dl.pct(times, 50):.1f} p99 {dl.pct(times, 99):.1f} µs, "
              f"{sum(t > 50 for t in times)} of {samples} over 50 µs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=3000)
    args = ap.parse_args()
    setup = argparse.Namespace(**{**dl.SIZES, "samples": args.samples}, engine_load=False, baseline=None)
    core = dl.current_core()
    fleet, long_system = dl.build_fleet(core, setup)
    strategy = core.make_strategy("cache_aware")
    rng = random.Random(1)
    for label in ("warm", "cold"):
        raws = [json.dumps(dl.body(long_system if label == "warm" else f"{n} " + long_system,
                                   f"question {n} " + dl.words(rng, 150))).encode() for n in range(args.samples)]
        report(label, traced(core, strategy, fleet, raws))
    interruptions(2 * args.samples)


if __name__ == "__main__":
    main()
