#!/usr/bin/env python3
"""What a client's choice of tenant, priority and API key costs the router's /metrics (issue #34): a `warmroute serve`
process in front of one stand-in engine that holds its one slot (engine_capacity 1), then N requests each with its own
x-priority, x-tenant and bearer key, queued and then abandoned by their client (each leaves samples in the queue
metrics), then /metrics scraped. Prints the scrape's size and time, /dashboard/state's time, /livez's latency while a
scrape runs, and the router's RSS before and after.

    .venv/bin/python benchmarks/metrics_labels.py [--requests 10000] [--code DIR] [--trust-client-headers]

`--code DIR` runs the router from another checkout (the code before a change); `--trust-client-headers` makes the
router believe the headers (a gateway in front), the worst case for this checkout. Timings are wall-clock on this
machine, medians of --scrapes scrapes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


async def engine(gate: asyncio.Event) -> tuple[web.AppRunner, str]:
    """/health answers; every other request waits for `gate`."""
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def held(request: web.Request) -> web.Response:
        await request.read()
        await gate.wait()
        return web.json_response({"ok": True})
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", held)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def timed_get(client: aiohttp.ClientSession, url: str) -> tuple[float, int]:
    start = time.perf_counter()
    async with client.get(url) as r:
        body = await r.read()
    return time.perf_counter() - start, len(body)


async def run(args: argparse.Namespace) -> None:
    gate = asyncio.Event()
    runner, engine_url = await engine(gate)
    port = free_port()
    code = Path(args.code).resolve() if args.code else ROOT
    argv = [sys.executable, "-m", "warmroute", "serve", "--backend", f"e={engine_url}", "--port", str(port),
            "--engine-capacity", "1", "--no-engine-metrics", "--models-interval", "0", "--health-interval", "3600",
            "--log-level", "warning", *(["--trust-client-headers"] if args.trust_client_headers else [])]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, cwd=code, env={**os.environ, "PYTHONPATH": str(code)}, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
            for _ in range(300):
                try:
                    async with client.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            else:
                log.seek(0)
                raise SystemExit(f"the router did not start: {log.read()[-2000:].decode(errors='replace')}")
            chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
            blocker = asyncio.ensure_future(client.post(url + "/v1/chat/completions", json=chat))
            await asyncio.sleep(0.5)
            rss_before = rss_mib(proc.pid)
            size_before = (await timed_get(client, url + "/metrics"))[1]
            sem = asyncio.Semaphore(args.concurrency)

            async def abandoned(i: int) -> None:
                headers = {"x-priority": str(i % 2001 - 1000), "x-tenant": f"tenant-{i}",
                           "Authorization": f"Bearer sk-{i}"}
                async with sem:
                    try:
                        async with client.post(url + "/v1/chat/completions", json=chat, headers=headers,
                                               timeout=aiohttp.ClientTimeout(total=args.wait)) as r:
                            await r.read()
                    except (asyncio.TimeoutError, aiohttp.ClientError):
                        pass  # queued, then the client left: what the probe of issue #34 did
            start = time.perf_counter()
            await asyncio.gather(*(abandoned(i) for i in range(args.requests)))
            sent_s = time.perf_counter() - start
            await asyncio.sleep(1.0)
            scrapes = [await timed_get(client, url + "/metrics") for _ in range(args.scrapes)]
            states = [(await timed_get(client, url + "/dashboard/state"))[0] for _ in range(args.scrapes)]

            async def livez_during_scrape() -> float:
                scrape = asyncio.ensure_future(timed_get(client, url + "/metrics"))
                await asyncio.sleep(0.005)
                seconds = (await timed_get(client, url + "/livez"))[0]
                await scrape
                return seconds
            livez = [await livez_during_scrape() for _ in range(args.scrapes)]
            rss_after = rss_mib(proc.pid)
            gate.set()
            (await blocker).close()
    finally:
        proc.terminate()
        proc.wait(10)
        await runner.cleanup()
    size = scrapes[-1][1]
    print(f"router: {code} ({'trust_client_headers' if args.trust_client_headers else 'defaults'})")
    print(f"{args.requests:,} requests, each its own x-priority, x-tenant and API key, queued then abandoned "
          f"({sent_s:.1f} s)")
    print(f"/metrics: {size_before / 1024:.0f} KiB before, {size / 1024:.0f} KiB after; "
          f"scrape median {statistics.median(s for s, _ in scrapes) * 1000:.1f} ms "
          f"(max {max(s for s, _ in scrapes) * 1000:.1f} ms)")
    print(f"/dashboard/state: median {statistics.median(states) * 1000:.1f} ms")
    print(f"/livez during a scrape: median {statistics.median(livez) * 1000:.1f} ms, max {max(livez) * 1000:.1f} ms")
    print(f"RSS: {rss_before:.0f} MiB before, {rss_after:.0f} MiB after ({rss_after - rss_before:+.1f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=256, help="requests open at once")
    parser.add_argument("--wait", type=float, default=0.3, help="seconds each request waits before its client leaves")
    parser.add_argument("--scrapes", type=int, default=5)
    parser.add_argument("--code", help="run the router from this checkout instead")
    parser.add_argument("--trust-client-headers", action="store_true")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
