#!/usr/bin/env python3
"""Soak: many concurrent streaming clients through one router process for minutes; report its RSS growth.

    .venv/bin/python benchmarks/soak.py --minutes 10 [--clients 500] [--chunks 20] [--gap 0.25]

Three processes on 127.0.0.1 (warmroute.bench.stream_load): a trivial instance (streams `chunks` tokens `gap`
seconds apart), `warmroute serve` in front of it, and this one running `clients` closed-loop streaming
clients, each with its own prompt. The router's RSS is read from /proc every few seconds; growth is measured
from the end of the warm-up (the first 20% of the run, at least 20 s) to the end. Prints one JSON line:
requests, errors, RSS at warm-up and at the end, growth in percent (target: under 5%).

tests/reliability/test_reliability_load.py uses the same harness for its 2,000-stream test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from warmroute.bench.stream_load import Tally, client_session, raise_fd_limit, rss_kib, start_stack, stream_once


async def soak(minutes: float, clients: int, chunks: int, gap: float) -> dict:
    raise_fd_limit()
    stack = await start_stack(1000 * gap)
    tally = Tally()
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    end = start + minutes * 60
    warm_until = start + max(20.0, 0.2 * minutes * 60)
    try:
        async with client_session() as s:
            async def client(i: int) -> None:
                n = 0
                while time.monotonic() < end:
                    await stream_once(s, stack.url, i * 1_000_000 + n, chunks, tally)
                    n += 1

            async def sampler() -> None:
                while time.monotonic() < end:
                    samples.append((time.monotonic() - start, rss_kib(stack.router.pid)))
                    await asyncio.sleep(5)

            await asyncio.gather(sampler(), *(client(i) for i in range(clients)))
        final = rss_kib(stack.router.pid)
    finally:
        await stack.close()
    warm = [kib for t, kib in samples if t >= warm_until - start]
    base = warm[0] if warm else samples[0][1]
    return {"minutes": minutes, "clients": clients, "requests_ok": tally.ok, "errors": tally.errors,
            "error_kinds": tally.kinds, "rss_kib_after_warmup": base, "rss_kib_end": final,
            "rss_kib_max": max(k for _, k in samples), "rss_growth_pct": round(100 * (final - base) / base, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--gap", type=float, default=0.25)
    a = ap.parse_args()
    result = asyncio.run(soak(a.minutes, a.clients, a.chunks, a.gap))
    print(json.dumps(result))
    sys.exit(0 if result["errors"] == 0 and result["rss_growth_pct"] < 5 else 1)


if __name__ == "__main__":
    main()
