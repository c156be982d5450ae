"""`warmroute demo`: a local emulated fleet of 4 instances, three routing strategies, one table.

For each strategy (random, prefix, cache_aware) in turn: start the emulated engines cold, start the router
in front of them, drive the same workload (same seed) through it, stop both. Every instance's KV cache holds
about a quarter of the workload's working set, so the fleet can hold it all only if requests that share a
prefix meet on the same instance: random routing spreads every prefix everywhere, and misses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from warmroute.bench.cli import add_workload_arguments, workload_from_args
from warmroute.bench.formats import pct
from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.processes import Child, free_ports
from warmroute.bench.report import COMPACT_ROWS, print_results
from warmroute.bench.stats import BenchResult
from warmroute.core.strategies import STRATEGIES as ROUTER_STRATEGIES
from warmroute.errors import UsageError
from warmroute.workloads import Workload

STRATEGIES = ("random", "prefix", "cache_aware")
INSTANCES = 4
MAX_TOKENS = 8  # short answers: prefill, which routing changes, dominates; fewer SSE chunks to push through Python


@dataclass(frozen=True)
class FleetPlan:
    """How the demo's fleet and load are sized (chosen so emulated engine time, not Python, dominates)."""

    instances: int = INSTANCES
    kv_capacity_tokens: int = 0  # per instance: a quarter of the working set
    time_scale: float = 0.25  # real seconds per emulated second
    max_running: int = 8  # sequences an instance runs at once
    concurrency: int = 16  # sessions in flight (closed loop)

    def engine_args(self, port: int) -> list[str]:
        return ["engine", "--count", str(self.instances), "--port", str(port),
                "--kv-capacity-tokens", str(self.kv_capacity_tokens), "--time-scale", f"{self.time_scale:g}",
                "--max-running", str(self.max_running)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, default="mixed")
    parser.add_argument("--duration", type=float, default=15.0, metavar="S",
                        help="measured seconds per strategy (default 15)")
    parser.add_argument("--warmup", type=float, default=5.0, metavar="S",
                        help="unmeasured seconds per strategy, filling the caches (default 5)")
    parser.add_argument("--concurrency", type=int, default=FleetPlan.concurrency, metavar="C",
                        help=f"sessions in flight (default {FleetPlan.concurrency})")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), metavar="NAME",
                        help=f"routing strategies to compare (default: {' '.join(STRATEGIES)})")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write the TTFT distribution of each strategy")


def plan_for(workload: Workload, concurrency: int) -> FleetPlan:
    ws = workload.working_set_tokens(concurrency) * engine_tokens_per_estimated_token(workload)
    return FleetPlan(kv_capacity_tokens=max(4096, int(ws) // INSTANCES), concurrency=concurrency)


def engine_tokens_per_estimated_token(workload: Workload, sample: int = 200) -> float:
    """How many tokens the emulated engine's tokenizer makes of what the workload sizes at ~4 bytes a token,
    over its first requests, so that the engines' caches (counted in their own tokens) hold the share of the
    working set the demo says."""
    from warmroute.core.routing_key import key_for_json
    from warmroute.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    engine = estimated = 0
    for session in workload.sessions():
        for r in session.requests:
            ids = (tokenizer.chat_ids(r.body) if "messages" in r.body
                   else tokenizer.completion_ids(r.body.get("prompt")))
            engine += len(ids)
            estimated += key_for_json(r.path, r.body).tokens
            sample -= 1
        if sample <= 0:
            break
    return engine / estimated if estimated else 1.0


def run(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or not args.duration > 0 or args.warmup < 0:
        raise UsageError("--concurrency must be >= 1, --duration > 0 and --warmup >= 0")
    unknown = [s for s in args.strategies if s not in ROUTER_STRATEGIES]
    if unknown:
        raise UsageError(f"unknown strategy {unknown[0]!r} (choose from {', '.join(ROUTER_STRATEGIES)})")
    if args.plot:
        from warmroute.bench.plot import require_matplotlib

        require_matplotlib()
    if args.max_tokens is None and args.workload != "trace":
        args.max_tokens = MAX_TOKENS
    workload = workload_from_args(args)
    plan = plan_for(workload, args.concurrency)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # stop the children on `kill` too, not only on Ctrl-C
    console = Console(stderr=True)
    if not args.json:
        console.print(f"[bold]warmroute demo[/]: {plan.instances} emulated instances, "
                      f"{plan.kv_capacity_tokens:,} KV tokens each (a quarter of the '{workload.name}' "
                      f"working set), {plan.concurrency} concurrent sessions, "
                      f"{args.warmup:g}+{args.duration:g} s per strategy")
    try:
        results = asyncio.run(_compare(workload, plan, args, console))
    finally:
        signal.signal(signal.SIGTERM, previous)  # a caller in the same process (a test) keeps its own handler
    _report(results, plan, args)
    return 0 if all(r.ok for r in results) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def _compare(workload: Workload, plan: FleetPlan, args: argparse.Namespace,
                   console: Console) -> list[BenchResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="warmroute-demo-") as logs:
        for strategy in args.strategies:
            results.append(await _one(strategy, workload, plan, args, Path(logs)))
            if not args.json:
                r = results[-1].summary()
                console.print(f"  {strategy:<12} {r['requests']:>5} requests, hit rate "
                              f"{pct(r['hit_rate']['fleet'])}, TTFT p50 {r['ttft_ms']['p50']} ms")
    return results


async def _one(strategy: str, workload: Workload, plan: FleetPlan, args: argparse.Namespace,
               logs: Path) -> BenchResult:
    """Fresh engines (cold caches) and a fresh router for one strategy; both stopped whatever happens."""
    engine_port = free_ports(plan.instances)
    urls = [f"http://127.0.0.1:{engine_port + i}" for i in range(plan.instances)]
    with Child(f"engines-{strategy}", plan.engine_args(engine_port), logs) as engines:
        await engines.wait_for_log("listening on", plan.instances, timeout_s=30)
        router_port = free_ports(1, engine_port + plan.instances)
        backends = [f"engine-{i}={u}" for i, u in enumerate(urls)]
        router_args = ["serve", "--port", str(router_port), "--strategy", strategy,
                       "--kv-capacity-tokens", str(plan.kv_capacity_tokens)]
        for backend in backends:
            router_args += ["--backend", backend]
        with Child(f"router-{strategy}", router_args, logs) as router:
            target = f"http://127.0.0.1:{router_port}"
            await router.wait_for_http(target + "/health", timeout_s=30)
            settings = BenchSettings(concurrency=plan.concurrency, duration_s=args.duration, warmup_s=args.warmup,
                                     seed=args.seed, engine_metrics=[u + "/metrics" for u in urls],
                                     label=strategy, progress=sys.stderr.isatty() and not args.json, drain_s=5.0)
            return await run_bench(target, workload, settings)


def _report(results: list[BenchResult], plan: FleetPlan, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps({"fleet": plan.__dict__, "results": [r.summary() for r in results]}, indent=2))
    else:
        print_results(results, rows=COMPACT_ROWS, title="warmroute demo: routing strategies, same workload, same fleet")
        line = _verdict(results)
        if line:
            Console().print(line)
    if args.plot:
        from warmroute.bench.plot import plot_ttft

        try:
            plot_ttft(results, args.plot)
        except OSError as exc:
            raise UsageError(f"cannot write {args.plot}: {exc.strerror or exc}") from None


def _verdict(results: list[BenchResult]) -> str:
    """cache_aware against random, in one line, when both ran."""
    by = {r.label: r.summary() for r in results}
    base, best = by.get("random"), by.get("cache_aware")
    if not base or not best:
        return ""
    p50 = _change(base["ttft_ms"]["p50"], best["ttft_ms"]["p50"])
    p99 = _change(base["ttft_ms"]["p99"], best["ttft_ms"]["p99"])
    tput = _change(base["throughput"]["requests_per_s"], best["throughput"]["requests_per_s"])
    return (f"cache_aware vs random: TTFT p50 {p50}, p99 {p99}, throughput {tput}, token hit rate "
            f"{pct(base['hit_rate']['fleet'])} -> {pct(best['hit_rate']['fleet'])}")


def _change(old: float | None, new: float | None) -> str:
    return "-" if not old or new is None else f"{100 * (new - old) / old:+.0f}%"
