#!/usr/bin/env python3
"""CPU per proxied request of the router's upstream client: aiohttp's ClientSession against UpstreamPool.

    .venv/bin/python benchmarks/upstream_client.py [--requests 8000] [--connections 16] [--rounds 4]

One trivial instance (warmroute.bench.trivial) runs in a child process; this process sends the same small
chat completion (≈ 250 bytes, non-streamed, answer ≈ 400 bytes) over `--connections` keep-alive connections,
`--requests` in all, first with aiohttp's client configured as the router configured it before (pooled
connector, no decompression, no auto headers, no cookies), then with warmroute.router.upstream.UpstreamPool,
alternating for `--rounds` rounds so both see the same machine. Prints this process's CPU time per request
(time.process_time: the client's own work, not the instance's) and wall time per request, medians over
the rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from multidict import CIMultiDict

from warmroute.bench.processes import Child
from warmroute.router.upstream import UpstreamPool

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 30}], "max_tokens": 8,
                   "stream": False}).encode()
HEADERS = [("Content-Type", "application/json"), ("Authorization", "Bearer benchmark")]


async def with_aiohttp(base: str, requests: int, connections: int) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0), auto_decompress=False,
                                    skip_auto_headers=("User-Agent", "Accept-Encoding"),
                                    cookie_jar=aiohttp.DummyCookieJar())
    url = base + "/v1/chat/completions"

    async def one_connection(n: int) -> None:
        for _ in range(n):
            resp = await session.request("POST", url, data=BODY, headers=CIMultiDict(HEADERS), allow_redirects=False)
            await resp.read()
            resp.release()

    await asyncio.gather(*(one_connection(requests // connections) for _ in range(connections)))
    await session.close()


async def with_pool(base: str, requests: int, connections: int) -> None:
    pool = UpstreamPool(connect_timeout=5)

    async def one_connection(n: int) -> None:
        for _ in range(n):
            resp = await pool.request(base, "POST", "/v1/chat/completions", HEADERS, BODY)
            while await resp.read_chunk():
                pass
            resp.release()

    await asyncio.gather(*(one_connection(requests // connections) for _ in range(connections)))
    await pool.close()


async def measure(args: argparse.Namespace, base: str) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {"aiohttp ClientSession": [], "UpstreamPool": []}
    clients = {"aiohttp ClientSession": with_aiohttp, "UpstreamPool": with_pool}
    await with_pool(base, 500, args.connections)  # warm-up: imports, the instance's first requests
    for r in range(args.rounds):
        order = list(clients) if r % 2 == 0 else list(reversed(clients))
        for name in order:
            cpu, wall = time.process_time(), time.perf_counter()
            await clients[name](base, args.requests, args.connections)
            n = args.requests // args.connections * args.connections
            results[name].append(((time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6))
    return results


async def _measure_against(child: Child, args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    return await measure(args, await child.wait_for_url(timeout_s=30))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8000)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    import uvloop

    with tempfile.TemporaryDirectory(prefix="warmroute-upstream-client-") as logs:
        with Child("instance", ["--count", "1", "--port", "0"], Path(logs), module="warmroute.bench.trivial") as child:
            results = uvloop.run(_measure_against(child, args))
    print(f"{args.requests} requests per round over {args.connections} connections, {args.rounds} rounds "
          "(alternating order); medians over the rounds")
    print(f"{'client':<24}{'CPU µs/request':>16}{'wall µs/request':>17}   CPU per round")
    cpu = {}
    for name, rows in results.items():
        cpu[name] = statistics.median(c for c, _ in rows)
        wall = statistics.median(w for _, w in rows)
        print(f"{name:<24}{cpu[name]:>16.1f}{wall:>17.1f}   " + ", ".join(f"{c:.1f}" for c, _ in rows))
    print(f"UpstreamPool uses {cpu['UpstreamPool'] / cpu['aiohttp ClientSession']:.2f}x aiohttp's CPU per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
