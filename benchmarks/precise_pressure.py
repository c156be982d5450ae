#!/usr/bin/env python3
"""KV pressure over HTTP: precise mode (the engines' KV events) against the approximate model and random, on an
emulated fleet whose engines publish their events.

    PYTHONPATH=. .venv/bin/python benchmarks/precise_pressure.py [--instances 4] [--kv-tokens 30000]
        [--docs 60] [--doc-tokens 1500] [--question-tokens 300] [--concurrency 8] [--duration 30]
        [--time-scale 0.05] [--router-kv-tokens N]

llm-d's shape, scaled down: `docs` customers, each a `doc-tokens` context (the `rag` workload, one document a
request, uniform popularity) and a unique question; by default the contexts need 75% of the fleet's KV cache.
Each contender gets a fresh fleet (empty caches) and its own router; closed loop. `--router-kv-tokens` tells the
approximate router a wrong capacity (feedback off then), to see what the model loses when its eviction guess is
wrong. Prints the bench table (TTFT, hit rate, prediction error per mode).
"""

from __future__ import annotations

import argparse
import asyncio

from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.report import print_results
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import start_fleet
from warmroute.engine.tokenizer import default_tokenizer_dir
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings
from warmroute.workloads import make_workload


async def one(args: argparse.Namespace, label: str, router_settings: dict):
    config = EngineConfig.from_profile("8b", kv_capacity_tokens=args.kv_tokens)
    fleet = await start_fleet(args.instances, config=config, time_scale=args.time_scale, kv_events_port=0)
    backends = [{"name": s.name, "url": s.url, "kv_events_endpoint": s.kv_events.endpoint,
                 "kv_events_replay_endpoint": s.kv_events.replay_endpoint} for s in fleet.servers]
    router = await start_router(load_settings({"backends": backends, "port": 0, "kv_capacity_tokens": args.kv_tokens,
                                               **router_settings}, env={}))
    try:
        workload = make_workload("rag", seed=args.seed, docs=args.docs, doc_tokens=args.doc_tokens,
                                 question_tokens=args.question_tokens, zipf=0.0, systems=1, system_tokens=50,
                                 max_tokens=8)
        result = await run_bench(router.url, workload, BenchSettings(
            concurrency=args.concurrency, duration_s=args.duration, warmup_s=args.warmup, seed=args.seed))
        result.label = label
        return result
    finally:
        await router.stop()
        await fleet.close()


async def main(args: argparse.Namespace) -> None:
    tokenizer = str(default_tokenizer_dir())
    approximate = {"strategy": "cache_aware"}
    if args.router_kv_tokens:
        approximate.update(kv_capacity_tokens=args.router_kv_tokens, engine_feedback=False)
    contenders = {"precise": {"strategy": "cache_aware", "kv_events": True, "tokenizer": tokenizer},
                  "approximate": approximate, "random": {"strategy": "random"}}
    results = [await one(args, label, contenders[label]) for label in args.order.split(",")]
    print_results(results, title=f"rag under KV pressure: {args.docs} x {args.doc_tokens}-token contexts, "
                                 f"{args.instances} x {args.kv_tokens} KV tokens")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--kv-tokens", type=int, default=30_000)
    ap.add_argument("--router-kv-tokens", type=int, default=0)
    ap.add_argument("--docs", type=int, default=60)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--question-tokens", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", default="precise,approximate,random", help="contenders, run in this order")
    return ap.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse()))
