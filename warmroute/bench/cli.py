"""`warmroute bench`: drive a workload through an endpoint; report TTFT, throughput, hit rate, load spread."""

from __future__ import annotations

import argparse
import sys
import asyncio
from urllib.parse import urlsplit

from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.report import print_results
from warmroute.errors import UsageError
from warmroute.workloads import WORKLOADS, Workload, make_workload, parse_params


def add_workload_arguments(parser: argparse.ArgumentParser, default: str = "mixed") -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", default=default, metavar="NAME",
                   help=f"one of {', '.join(WORKLOADS)} (default {default})")
    g.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0)")
    g.add_argument("--max-tokens", type=int, help="output tokens per request (trace: a cap on its lengths)")
    g.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a workload size, e.g. pool_size=64 or zipf=0.8 (repeatable)")
    g.add_argument("--trace", metavar="FILE", help="Mooncake-format JSONL trace (workload 'trace')")
    g.add_argument("--trace-limit", type=int, metavar="N", help="replay only the first N requests")


def workload_from_args(args: argparse.Namespace) -> Workload:
    params: dict[str, object] = parse_params(args.param)
    if args.max_tokens is not None:
        if args.max_tokens < 1:
            raise UsageError("--max-tokens must be >= 1")
        params["max_tokens"] = args.max_tokens
    if args.workload == "trace":
        params.update(path=args.trace or "", limit=args.trace_limit)
    elif args.trace or args.trace_limit:
        raise UsageError("--trace and --trace-limit need --workload trace")
    return make_workload(args.workload, args.seed, **params)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="URL", help="base URL, e.g. http://127.0.0.1:8000")
    add_workload_arguments(parser)
    g = parser.add_argument_group("load")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, metavar="C", help="closed loop: C sessions in flight")
    mode.add_argument("--rate", type=float, metavar="QPS", help="open loop: Poisson session arrivals per second")
    g.add_argument("--speedup", type=float, default=1.0, help="trace replay: run its clock this much faster")
    g.add_argument("--duration", type=float, default=30.0, metavar="S", help="measured seconds (default 30)")
    g.add_argument("--warmup", type=float, default=5.0, metavar="S", help="unmeasured seconds first (default 5)")
    g.add_argument("--timeout", type=float, default=120.0, metavar="S", help="per request (default 120)")
    g.add_argument("--model", help="model name to send (default: the first the target lists)")
    o = parser.add_argument_group("output")
    o.add_argument("--engine-metrics", nargs="+", default=[], metavar="URL",
                   help="each instance's /metrics, for the fleet's token hit rate")
    o.add_argument("--label", default="", help="column title (default: the workload name)")
    o.add_argument("--json", action="store_true", help="print the results as JSON (stable keys)")
    o.add_argument("--plot", metavar="FILE.png", help="write the TTFT distribution")


def metrics_url(url: str) -> str:
    """An instance's /metrics URL from its base URL or the full URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"not an http(s) URL: {url!r}")
    return url if parts.path not in ("", "/") else url.rstrip("/") + "/metrics"


def settings_from_args(args: argparse.Namespace, workload: Workload) -> BenchSettings:
    timed = workload.name == "trace"
    return BenchSettings(
        concurrency=16 if args.concurrency is None and args.rate is None and not timed else args.concurrency,
        rate=args.rate, duration_s=args.duration, warmup_s=args.warmup, seed=args.seed,
        speedup=args.speedup, model=args.model, timeout_s=args.timeout,
        engine_metrics=[metrics_url(u) for u in args.engine_metrics], label=args.label,
        progress=sys.stderr.isatty() and not args.json,
    )


def run(args: argparse.Namespace) -> int:
    target = args.target.rstrip("/")
    if urlsplit(target).scheme not in ("http", "https"):
        raise UsageError(f"--target must be an http(s) URL, got {args.target!r}")
    if args.plot:
        from warmroute.bench.plot import require_matplotlib

        require_matplotlib()
    workload = workload_from_args(args)
    result = asyncio.run(run_bench(target, workload, settings_from_args(args, workload)))
    print_results([result], as_json=args.json)
    if args.plot:
        from warmroute.bench.plot import plot_ttft

        try:
            plot_ttft([result], args.plot)
        except OSError as exc:
            raise UsageError(f"cannot write {args.plot}: {exc.strerror or exc}") from None
    return 0 if result.ok else 1
