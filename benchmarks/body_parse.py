#!/usr/bin/env python3
"""How long a large request body stalls the router's event loop while its routing key is built and its
instance chosen, as the router did before (stdlib json, all in the loop) and does now (msgspec, the key of a
body of 1 MiB or more built in a thread: Router.key_off_loop), side by side.

    .venv/bin/python benchmarks/body_parse.py [--mib 28] [--shape long|many] [--repeats 5]

`long`: a few hundred messages of 100,000 characters (a long document or conversation); `many`: 200,000
short messages. A ticker task sleeps 1 ms in a loop meanwhile; the longest gap between two of its ticks is the
stall every other request sees. Prints, per mode, the median and max of that longest gap and of the time to
the decision, in ms, over alternating repeats (so both see the same machine load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import string
import time

from warmroute.router import routing
from warmroute.router.metrics import Metrics
from warmroute.router.routing import Router
from warmroute.router.settings_load import load_settings

PATH = "/v1/chat/completions"


def body_of(mib: float, shape: str) -> bytes:
    rng = random.Random(1)
    if shape == "long":
        n = max(1, int(mib * 2**20 / 100_000))
        msgs = [{"role": "user", "content": "".join(rng.choices(string.ascii_letters + " ", k=100_000))}
                for _ in range(n)]
    else:
        n = int(mib * 2**20 / 150)
        msgs = [{"role": "user", "content": f"message {i} " + "hello world " * 8} for i in range(n)]
    return json.dumps({"model": "m", "messages": msgs}).encode()


async def one(router: Router, body: bytes, off_loop: bool) -> tuple[float, float]:
    """(longest loop gap, time to decision) in ms for one request's routing."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    start = time.perf_counter()
    key = await router.key_off_loop(PATH, body, None) if off_loop else None
    router.route(PATH, body, None, key)
    took = time.perf_counter() - start
    await asyncio.sleep(0.01)
    done.set()
    await task
    return max(gaps) * 1e3, took * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=28)
    ap.add_argument("--shape", choices=("long", "many"), default="long")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    settings = load_settings({"backends": ["a=http://127.0.0.1:1", "b=http://127.0.0.1:2"]}, env={})
    body = body_of(args.mib, args.shape)
    modes = {"before: json, in the loop": (json.loads, False), "now: msgspec, key in a thread": (routing._decode, True)}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, (parse, off_loop) in modes.items():
            routing._decode = parse
            router = Router(settings, Metrics(settings.strategy, ["a", "b"]))  # a fresh index: a cold prompt
            results[name].append(asyncio.run(one(router, body, off_loop)))
    print(f"body {len(body) / 2**20:.1f} MiB ({args.shape}), {args.repeats} repeats, ms (median / max):")
    for name, rows in results.items():
        gaps, took = [r[0] for r in rows], [r[1] for r in rows]
        print(f"  {name:32s} longest loop gap {statistics.median(gaps):6.1f} / {max(gaps):6.1f}   "
              f"to decision {statistics.median(took):6.1f} / {max(took):6.1f}")


if __name__ == "__main__":
    main()
