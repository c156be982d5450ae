#!/usr/bin/env python3
"""Scale events over HTTP: emulated engines as the pods of a Service in a test Kubernetes API
(warmroute/bench/kube_api.py), a router discovering them, a workload (the demo's mixed one by default) in open loop
(warmroute.bench.loadgen).

    .venv/bin/python benchmarks/autoscale_http.py scale-in  [--before 25] [--after 25] [--rate 3] [--workload W] [--seed N]
    .venv/bin/python benchmarks/autoscale_http.py scale-out [--before 15] [--after 30] [--rate 3] [--window 20]
        [--slo MS] [--workload W] [--seed N]

  scale-in   4 pods. At --before seconds a ReplicaSet-style scale-in terminates one pod, chosen three ways in
             three fresh runs (same workload, same seed): the pod with the lowest deletion cost (what a
             ReplicaSet does with the router's annotations), the median one, the highest one (what an arbitrary
             choice may hit). Per run: each pod's cache value and annotation at the event, the hit rate (the
             engines' cached tokens over prompt tokens, as they reported them) over the --after seconds before
             and after the event, the loss, TTFT p50/p99 after.
  scale-out  3 pods ready, a fourth becomes ready at --before seconds; with slow start (--window seconds) and
             without (0), in two fresh runs. Per 5-second bin after the join: the new pod's share of requests,
             its hit rate, TTFT p99 of all requests and of the new pod's, against --slo.

Each run starts a fresh fleet with cold caches. The machine's load (other processes on it) moves TTFTs: compare
contenders within one invocation, which runs them back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from warmroute.bench.kube_api import Stack
from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.stats import RequestRecord, percentile
from warmroute.workloads.registry import make_workload

PODS = 4
BIN_S = 5.0


def hit(records: Sequence[RequestRecord]) -> float | None:
    done = [r for r in records if r.ok and r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    return sum(r.cached_tokens or 0 for r in done) / prompt if prompt else None


def ttft_ms(records: Sequence[RequestRecord], q: float) -> float | None:
    p = percentile([r.ttft_s for r in records if r.ok and r.ttft_s is not None], q)
    return None if p is None else p * 1000


def fmt(x: float | None, unit: str = "", digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


async def run_with_event(stack: Stack, args: argparse.Namespace, event) -> list[RequestRecord]:
    """The workload at --rate sessions/s for --before + --after seconds; `event()` (a coroutine) at --before."""
    async def later() -> None:
        await asyncio.sleep(args.before)
        await event()

    task = asyncio.create_task(later())
    try:
        result = await run_bench(stack.url, make_workload(args.workload, seed=args.seed), BenchSettings(
            rate=args.rate, duration_s=args.before + args.after, warmup_s=0.0, drain_s=10.0))
    finally:
        await task
    return result.records


async def scale_in(args: argparse.Namespace) -> None:
    print(f"scale-in: {PODS} pods, {args.workload} workload at {args.rate:g} sessions/s, event at {args.before:g} s, "
          f"hit rate over {args.after:g} s either side")
    rows = []
    for choice in ("lowest", "median", "highest"):
        with tempfile.TemporaryDirectory() as tmp:
            stack = await Stack().start(Path(tmp), None, PODS, time_scale=1.0, **args.router)
            seen: dict = {}

            async def event() -> None:
                async with aiohttp.ClientSession() as client:
                    async with client.get(stack.url + "/admin/scale-in",
                                          headers={"Authorization": f"Bearer {Stack.TOKEN}"}) as r:
                        seen["answer"] = await r.json()
                seen["annotations"] = {p: stack.annotation(p) for p in stack.api.pods}
                by_cost = sorted(stack.api.pods, key=lambda p: (stack.annotation(p) or 0, p))
                pod = {"lowest": by_cost[0], "median": by_cost[len(by_cost) // 2], "highest": by_cost[-1]}[choice]
                seen["removed"], seen["at"] = pod, asyncio.get_running_loop().time()
                stack.set_pod(int(pod.rsplit("-", 1)[1]), terminating=True)

            try:
                records = await run_with_event(stack, args, event)
            finally:
                await stack.stop()
        before = [r for r in records if args.before - args.after <= r.start_s < args.before]
        after = [r for r in records if r.start_s >= args.before]
        answer, annotations = seen["answer"], seen["annotations"]
        print(f"\n  {choice}: removed {seen['removed']} (router's victim {answer['victim']})")
        costs = answer["deletion_costs"]
        for pod in sorted(annotations):
            print(f"    {pod}: value {answer['values'].get(pod, 0):9.1f} tokens   cost now {costs.get(pod)}"
                  f"   annotation {annotations[pod]}")
        pairs = [(a, b) for a in costs for b in costs if costs[a] < costs[b]]
        alike = sum(1 for a, b in pairs if (annotations[a] or 0) < (annotations[b] or 0))
        print(f"    pairs of pods the annotations order as the values now: {alike}/{len(pairs)} (the annotations "
              f"are up to {args.router['pod_deletion_cost_interval']:g} s old)")
        h0, h1 = hit(before), hit(after)
        first = hit([r for r in after if r.start_s < args.before + 10.0])
        rows.append((choice, h0, first, h1, None if h0 is None or h1 is None else h0 - h1, ttft_ms(after, 50),
                     ttft_ms(after, 99), len(after)))
    print("\n  removed pod | hit before | hit 0-10 s after | hit after | loss | TTFT p50 after | TTFT p99 after | "
          "requests after")
    for choice, h0, first, h1, loss, p50, p99, n in rows:
        print(f"  {choice:11} | {pct(h0):>10} | {pct(first):>16} | {pct(h1):>9} | {pct(loss):>5} | "
              f"{fmt(p50, ' ms'):>14} | {fmt(p99, ' ms'):>14} | {n}")


async def scale_out(args: argparse.Namespace) -> None:
    print(f"scale-out: {PODS - 1} pods, a fourth ready at {args.before:g} s; {args.workload} workload at {args.rate:g} "
          f"sessions/s; SLO: TTFT p99 <= {args.slo:g} ms per {BIN_S:g}-s window")
    for window in (args.window, 0.0):
        with tempfile.TemporaryDirectory() as tmp:
            stack = await Stack().start(Path(tmp), None, PODS, ready=PODS - 1, time_scale=1.0,
                                        slow_start_window=window, **args.router)

            async def event() -> None:
                stack.set_pod(PODS - 1)

            try:
                records = await run_with_event(stack, args, event)
            finally:
                await stack.stop()
        new = f"vllm-{PODS - 1}"
        print(f"\n  slow_start_window {window:g} s  (before the join: TTFT p99 "
              f"{fmt(ttft_ms([r for r in records if r.start_s < args.before], 99), ' ms')})")
        print("    from join | new pod's share | its hit rate | TTFT p99 all | TTFT p99 new pod | SLO met")
        met = total = 0
        for k in range(int(args.after // BIN_S)):
            start = args.before + k * BIN_S
            chunk = [r for r in records if start <= r.start_s < start + BIN_S]
            mine = [r for r in chunk if r.instance == new]
            p99 = ttft_ms(chunk, 99)
            ok = p99 is not None and p99 <= args.slo
            met, total = met + ok, total + 1
            print(f"    {start - args.before:5.0f} s   | {pct(len(mine) / len(chunk) if chunk else None):>15} | "
                  f"{pct(hit(mine)):>12} | {fmt(p99, ' ms'):>12} | {fmt(ttft_ms(mine, 99), ' ms'):>16} | "
                  f"{'yes' if ok else 'no'}")
        print(f"    windows within the SLO after the join: {met}/{total}; errors: "
              f"{sum(1 for r in records if not r.ok)} of {len(records)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name, before, after in (("scale-in", 25.0, 25.0), ("scale-out", 15.0, 30.0)):
        s = sub.add_parser(name)
        s.add_argument("--before", type=float, default=before, help="seconds before the event")
        s.add_argument("--after", type=float, default=after, help="seconds after it")
        s.add_argument("--rate", type=float, default=3.0, help="sessions per second (open loop)")
        s.add_argument("--concurrency-threshold", type=int, default=32)
        s.add_argument("--workload", default="mixed", help="a workload of warmroute.workloads (mixed, rag, ...)")
        s.add_argument("--seed", type=int, default=0, help="the workload's seed (its texts and choices)")
    sub.choices["scale-out"].add_argument("--window", type=float, default=20.0, help="slow_start_window (s)")
    sub.choices["scale-out"].add_argument("--slo", type=float, default=2000.0, help="TTFT p99 SLO (ms)")
    args = p.parse_args(argv)
    args.router = {"concurrency_threshold": args.concurrency_threshold, "health_interval": 0.5,
                   "pod_deletion_cost_interval": 0.5}
    logging.getLogger("warmroute").setLevel(logging.ERROR)  # joins, drains: the report says what happened
    asyncio.run(scale_in(args) if args.what == "scale-in" else scale_out(args))


if __name__ == "__main__":
    main()
