#!/usr/bin/env python3
"""warmroute in front of real llama.cpp engines on CPUs: random vs cache_aware routing, side by side.

    .venv/bin/python benchmarks/llamacpp_fleet.py [--engines 4] [--duration 60] [--warmup 10] [--json]

Needs `pip install -e '.[llama]'`. Writes the tiny random-weight model (warmroute make-tiny-model) to a
temporary directory, then per strategy starts fresh llama-cpp-python servers (one thread each, a RAM prompt
cache of a few prompts) and `warmroute serve` in front of them, and drives 8 equally popular ~3.6 kB system
prompts with short unique questions through the router. Prints TTFT, throughput and the engines' own token
reuse (counted inside llama.cpp, see warmroute/realengine/reuse.py). Every process is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from warmroute.bench.report import print_results
from warmroute.bench.stats import BenchResult
from warmroute.errors import UsageError
from warmroute.realengine.fleet import LlamaFleetPlan, compare
from warmroute.realengine.tiny_model import write_tiny_model


def parse_args() -> argparse.Namespace:
    d = LlamaFleetPlan()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=d.engines, help=f"llama.cpp servers (default {d.engines})")
    p.add_argument("--cached-prompts", type=int, default=d.cached_prompts,
                   help=f"prompt states each engine's cache holds (default {d.cached_prompts})")
    p.add_argument("--prefixes", type=int, default=d.prefixes, help=f"shared system prompts (default {d.prefixes})")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help=f"clients (default {d.concurrency})")
    p.add_argument("--requests", type=int, help="requests per strategy (default: as many as fit the window)")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help=f"unmeasured seconds (default {d.warmup_s:g})")
    p.add_argument("--duration", type=float, default=d.duration_s, help=f"measured seconds (default {d.duration_s:g})")
    p.add_argument("--strategies", nargs="+", default=["random", "cache_aware"], metavar="NAME")
    p.add_argument("--logs", metavar="DIR", help="keep the engines' and routers' logs here")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so `kill` stops the children too, as Ctrl-C does


async def main(args: argparse.Namespace) -> list[BenchResult]:
    plan = replace(LlamaFleetPlan(), engines=args.engines, cached_prompts=args.cached_prompts,
                   prefixes=args.prefixes, concurrency=args.concurrency, requests=args.requests,
                   warmup_s=args.warmup, duration_s=args.duration)
    with tempfile.TemporaryDirectory(prefix="warmroute-llamacpp-") as tmp:
        model = write_tiny_model(Path(tmp) / "tiny.gguf", plan.model)
        logs = Path(args.logs) if args.logs else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        print(f"{plan.engines} llama.cpp engines, cache of {plan.cached_prompts} prompts "
              f"({plan.cache_bytes() / 2**20:.1f} MiB) each, {plan.prefixes} prefixes of "
              f"~{plan.prompt_tokens()} tokens per prompt, {plan.concurrency} clients", file=sys.stderr)
        return await compare(plan, args.strategies, model, logs, progress=not args.json)


def report(results: list[BenchResult], as_json: bool) -> None:
    if as_json:
        print(json.dumps([r.summary() for r in results], indent=2))
        return
    print_results(results, title="llama.cpp fleet (tiny model, CPU): routing strategies, same workload")
    by = {r.label: r.summary() for r in results}
    if "random" in by and "cache_aware" in by:
        base, best = by["random"]["ttft_ms"]["p50"], by["cache_aware"]["ttft_ms"]["p50"]
        if base and best:
            print(f"cache_aware TTFT p50 = {best / base:.2f} x random's")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    arguments = parse_args()
    try:
        report(asyncio.run(main(arguments)), arguments.json)
    except UsageError as exc:
        sys.exit(f"llamacpp_fleet: {exc}")
    except KeyboardInterrupt:
        sys.exit(130)
