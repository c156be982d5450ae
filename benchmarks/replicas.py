#!/usr/bin/env python3
"""Do several router replicas agree? The fleet hit rate with 1, 2 and 4 replicas in front of one fleet.

    .venv/bin/python benchmarks/replicas.py [--replicas 1 2 4] [--workload mixed] [--duration 30] [--quick]
                                            [--modes independent redis workers]

For every replica count N: a fresh emulated fleet (`warmroute engine --count 4`, cold caches, each instance's
KV capacity a quarter of the workload's working set, as in `warmroute demo`), N independent `warmroute serve`
processes (each its own prefix index; no shared state) in front of it, and a round-robin front
(`warmroute.bench.front`: a tiny streaming aiohttp proxy that sends each request to the next replica) in front
of those. The
same workload (same seed) runs through the front with `warmroute.bench.run_bench`; the fleet hit rate comes
from the engines' own prefix-cache counters over the measured window. With one replica the front is still
there, so every run pays the same extra hop. Mode `independent`: nothing shared between replicas; mode
`redis`: the replicas share index updates through a local `redis-server` (setting `redis_url`), started on a
free port for the run (needs Debian's redis-server and the redis package). Mode `workers`: one `warmroute
serve --workers N` instead of N replicas (its worker processes share index updates through local sockets,
no Redis), behind the same front.

Writes out/replicas.json (everything measured) and out/replicas.md (the report, the command line on top), to
replace the measured part of docs/replicas.md by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from warmroute.bench.cli import add_workload_arguments, workload_from_args
from warmroute.bench.demo import FleetPlan, plan_for
from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.processes import Child, free_ports
from warmroute.bench.record import OUT, command_line, write_outputs
from warmroute.bench.stats import BenchResult

# -- one measurement -----------------------------------------------------------------------------------------------
async def measure(replicas: int, mode: str, workload, plan: FleetPlan, args: argparse.Namespace,
                  logs: Path) -> BenchResult:
    engine_port = free_ports(plan.instances)
    urls = [f"http://127.0.0.1:{engine_port + i}" for i in range(plan.instances)]
    children: list[Child] = []
    shared: list[str] = []
    try:
        if mode == "redis":
            redis_port = free_ports(1, engine_port + plan.instances + 10)
            redis = Child.command(f"redis-{replicas}", ["redis-server", "--port", str(redis_port), "--bind",
                                                        "127.0.0.1", "--save", "", "--appendonly", "no"], logs)
            children.append(redis)
            await redis.wait_for_log("Ready to accept connections", 1, timeout_s=30)
            shared = ["--redis-url", f"redis://127.0.0.1:{redis_port}/0"]
        engines = Child(f"engines-{replicas}", plan.engine_args(engine_port), logs)
        children.append(engines)
        await engines.wait_for_log("listening on", plan.instances, timeout_s=60)
        router_port = free_ports(replicas + 1, engine_port + plan.instances + 20)
        routers: list[tuple[Child, str]] = []
        processes = 1 if mode == "workers" else replicas
        if mode == "workers":
            shared = ["--workers", str(replicas)]
        for r in range(processes):
            argv = ["serve", "--port", str(router_port + r), "--strategy", args.strategy,
                    "--kv-capacity-tokens", str(plan.kv_capacity_tokens), *shared]
            for i, u in enumerate(urls):
                argv += ["--backend", f"engine-{i}={u}"]
            children.append(Child(f"router-{replicas}-{r}", argv, logs))
            routers.append((children[-1], f"http://127.0.0.1:{router_port + r}"))
        for child, url in routers:
            await child.wait_for_http(url + "/health", timeout_s=60)
        front_port = router_port + processes
        front = Child(f"front-{replicas}", ["--port", str(front_port), *(url for _, url in routers)], logs,
                      module="warmroute.bench.front")
        children.append(front)
        target = f"http://127.0.0.1:{front_port}"
        await front.wait_for_http(target + "/health", timeout_s=30)
        settings = BenchSettings(concurrency=plan.concurrency, duration_s=args.duration, warmup_s=args.warmup,
                                 seed=args.seed, engine_metrics=[u + "/metrics" for u in urls],
                                 label=f"{replicas} {mode}", drain_s=5.0)
        return await run_bench(target, workload, settings)
    finally:
        for child in reversed(children):
            child.stop()


def report(results: list[BenchResult], plan: FleetPlan, args: argparse.Namespace, command: str) -> str:
    base = results[0].fleet_hit_rate
    lines = [
        "# Do router replicas agree?",
        "",
        "Fleet prefix-cache hit rate (the engines' own token counters over the measured window) with 1, 2 and 4",
        "`warmroute serve` replicas behind a per-request round-robin front, in front of one emulated fleet: each",
        "replica alone (`independent`: its own prefix index, nothing shared), sharing index updates through",
        "Redis (`redis`: setting `redis_url`), and one router with N worker processes (`workers`: `--workers N`,",
        "sharing through local sockets). Written by `benchmarks/replicas.py`.",
        "",
        "```sh",
        command,
        "```",
        "",
        f"Fleet: {plan.instances} emulated instances (8b profile), {plan.kv_capacity_tokens:,} KV tokens each "
        f"(a quarter of the `{args.workload}` working set), time scale {plan.time_scale:g}; {plan.concurrency} "
        f"concurrent sessions; strategy `{args.strategy}`; {args.warmup:g} s warm-up + {args.duration:g} s "
        f"measured; seed {args.seed}; {datetime.now(timezone.utc):%Y-%m-%d}, 2 shared CPU cores.",
        "",
        "| replicas | index | requests | fleet hit rate | vs 1 replica | TTFT p50 (ms) | TTFT p99 (ms) | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        s = r.summary()
        hit = r.fleet_hit_rate
        rel = f"{(hit - base) / base:+.1%}" if hit is not None and base else "-"
        n, mode = r.label.split()
        shown = "-" if hit is None else f"{hit:.1%}"
        lines.append(f"| {n} | {mode if n != '1' else 'one router'} | {s['requests']} | {shown} | {rel} "
                     f"| {s['ttft_ms']['p50']} | {s['ttft_ms']['p99']} | {s['errors'] or 'none'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, default="mixed")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategy", default="cache_aware")
    parser.add_argument("--modes", nargs="+", default=["independent", "redis", "workers"],
                        choices=["independent", "redis", "workers"],
                        help="for N > 1: N replicas alone, N replicas sharing through Redis, or one router with N "
                             "workers")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="10 s windows, 2 s warm-up")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.warmup = 10.0, 2.0
    if getattr(args, "max_tokens", None) is None and args.workload != "trace":
        args.max_tokens = 8
    workload = workload_from_args(args)
    plan = plan_for(workload, args.concurrency)
    command = command_line(__file__, sys.argv[1:])
    results = []
    with tempfile.TemporaryDirectory(prefix="warmroute-replicas-") as logs:
        runs = [(n, mode) for n in args.replicas for mode in (["independent"] if n == 1 else args.modes)]
        for n, mode in runs:
            result = asyncio.run(measure(n, mode, workload, plan, args, Path(logs)))
            print(f"{n} replica(s), {mode}: fleet hit rate {result.fleet_hit_rate}, {len(result.ok)} requests, "
                  f"errors {result.errors}", file=sys.stderr, flush=True)
            results.append(result)
    text = report(results, plan, args, command)
    print(text)
    if not args.no_write:
        write_outputs(OUT / "replicas.json", [r.summary() for r in results], text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
