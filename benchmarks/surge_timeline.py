"""One contender through overload.py's 2x surge, with what happened inside: every 2 s each engine's running and
waiting requests and KV usage, and (warmroute) the router's queue, requests in flight per instance, engine
limits and its decisions by reason since the last poll; after the run, the prompt tokens each request class missed
in the engines' caches, per 10 s of start time.

A diagnostic for issue #32 (why a contender's goodput falls behind another's), not a scored benchmark: run it for
each contender one after another, e.g.

    python benchmarks/surge_timeline.py flow-defaults
    python benchmarks/surge_timeline.py smg
    WARMROUTE_ENGINE_CAPACITY=300 python benchmarks/surge_timeline.py flow-defaults

Router settings reach warmroute (not smg) through WARMROUTE_* variables."""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overload  # noqa: E402  (the surge, its stack and its load generator)

from warmroute.bench.scrape import fetch_metrics  # noqa: E402
from warmroute.prometheus_text import read_samples  # noqa: E402

POLL_S = 2.0
ENGINE = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "kv": "vllm:kv_cache_usage_perc"}
ROUTER = {"inflight": "warmroute_inflight", "limit": "warmroute_engine_capacity", "queue": "warmroute_queue_waiting"}
DECISIONS = "warmroute_decisions_total"


def values(text: str, names: dict[str, str]) -> dict[str, list[float]]:
    """Per name, the values of its metric's series in label order (one per backend for the router's)."""
    found = read_samples(text, tuple(names.values()))
    return {k: [v for _labels, v in sorted(found.get(metric, []), key=lambda lv: sorted(lv[0].items()))]
            for k, metric in names.items()}


def decided(text: str, seen: collections.Counter) -> dict[str, int]:
    """The router's decisions by reason since the last poll (`seen`: the counts then, updated)."""
    now = collections.Counter()
    for labels, v in read_samples(text, (DECISIONS,)).get(DECISIONS, []):
        now[labels.get("reason", "")] += int(v)
    delta = {k: v - seen[k] for k, v in now.items() if v > seen[k]}
    seen.update(delta)
    return delta


async def poll(stack: overload.Stack, router: bool, rows: list[dict], stop: asyncio.Event) -> None:
    t0 = time.perf_counter()
    seen: collections.Counter = collections.Counter()
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            row: dict = {"t": round(time.perf_counter() - t0, 1)}
            for i, text in enumerate(await fetch_metrics(http, stack.metrics)):
                got = values(text, ENGINE)
                row[f"e{i}"] = [int(sum(got["running"])), int(sum(got["waiting"])), round(sum(got["kv"]), 2)]
            if router:
                text = (await fetch_metrics(http, [stack.target + "/metrics"]))[0]
                got = values(text, ROUTER)
                row.update(queue=int(sum(got["queue"])), inflight=[int(v) for v in got["inflight"]],
                           limit=[int(v) for v in got["limit"]], decided=decided(text, seen))
            rows.append(row)
            await asyncio.sleep(max(0.0, len(rows) * POLL_S - (time.perf_counter() - t0)))


async def run(label: str) -> None:
    args = overload.parse_args(["surge", "--contenders", label])
    args.logs = Path(tempfile.mkdtemp(prefix="warmroute-surge-timeline-"))
    contender = overload.CONTENDERS[label]
    cap = overload.capacity(args)
    rows: list[dict] = []
    async with overload.Stack(contender, args, slo=args.slo) as stack:
        stop = asyncio.Event()
        poller = asyncio.create_task(poll(stack, not contender.peer, rows, stop))
        recs, cache = await overload.offer(stack, overload.surge_streams(args, cap), args.seed,
                                           [5.0, args.high, args.high + args.low])
        stop.set()
        await poller
    print(json.dumps({"contender": label, "capacity_rps": round(cap, 1),
                      "overload": overload.window_stats(recs, 5.0, args.high, args.slo, cache[0], cache[1])}))
    for row in rows:
        print(json.dumps(row))
    print("start_s  per class: hit rate / prompt tokens missed (the engines' usage.cached_tokens)")
    for lo in range(0, int(args.high + args.low), 10):
        by: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for r in recs:
            if r.ok and r.prompt_tokens and lo <= r.start_s < lo + 10:
                by[r.tag][0] += r.prompt_tokens
                by[r.tag][1] += r.cached_tokens or 0
        print(lo, " ".join(f"{k}:{c / p:.3f}/{p - c}" for k, (p, c) in sorted(by.items())))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in overload.CONTENDERS:
        print(f"usage: surge_timeline.py {{{','.join(overload.CONTENDERS)}}}", file=sys.stderr)
        sys.exit(2)
    asyncio.run(run(sys.argv[1]))
