#!/usr/bin/env python3
"""Soak: many concurrent streaming clients through one router process for minutes; report its RSS growth.

    .venv/bin/python benchmarks/soak.py --minutes 10 [--clients 500] [--chunks 20] [--gap 0.25]

Three processes on 127.0.0.1: a trivial SSE upstream (answers at once, `chunks` events `gap` seconds apart),
`warmroute serve` in front of it, and this one running `clients` closed-loop streaming clients, each with its
own prompt. The router's RSS is read from /proc every few seconds; growth is measured from the end of the
warm-up (the first 20% of the run, at least 20 s) to the end. Prints one JSON line: requests, errors, RSS at
warm-up and at the end, growth in percent (target: under 5%).

tests/test_reliability_load.py uses the same harness for its 2,000-stream test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import sys
import time
from dataclasses import dataclass, field

import aiohttp

_UPSTREAM = r"""
import asyncio, json, sys
from aiohttp import web

async def sse(request):
    body = json.loads(await request.read())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(int(body.get("chunks", 5))):
        await resp.write(b'data: {"choices": [{"delta": {"content": "tok"}}]}\n\n')
        await asyncio.sleep(float(body.get("gap", 0.1)))
    await resp.write(b"data: [DONE]\n\n")
    return resp

async def health(request):
    return web.Response(text="ok")

app = web.Application()
app.router.add_get("/health", health)
app.router.add_post("/v1/chat/completions", sse)

async def main():
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    print("listening on http://127.0.0.1:%d" % runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()

try:
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""


def raise_fd_limit(want: int = 16384) -> int:
    """Child processes inherit it: 2,000 streams need 4,000 descriptors in the router."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@dataclass
class Stack:
    upstream: asyncio.subprocess.Process
    router: asyncio.subprocess.Process
    url: str
    _drains: list[asyncio.Task] = field(default_factory=list)

    async def close(self) -> None:
        for p in (self.router, self.upstream):
            if p.returncode is None:
                p.terminate()
                try:
                    await asyncio.wait_for(p.wait(), 10)
                except TimeoutError:
                    p.kill()
                    await p.wait()
        for t in self._drains:
            t.cancel()


async def _announced(proc: asyncio.subprocess.Process, stream: asyncio.StreamReader) -> tuple[str, asyncio.Task]:
    while True:
        line = (await asyncio.wait_for(stream.readline(), 30)).decode()
        if not line:
            raise RuntimeError(f"process {proc.pid} exited before listening")
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            break

    async def drain() -> None:  # keep reading so a chatty process never blocks on a full pipe
        while await stream.readline():
            pass
    return m.group(1), asyncio.create_task(drain())


async def start_stack(*router_args: str) -> Stack:
    up = await asyncio.create_subprocess_exec(sys.executable, "-c", _UPSTREAM, stdout=asyncio.subprocess.PIPE)
    assert up.stdout is not None
    try:
        up_url, d1 = await _announced(up, up.stdout)
    except BaseException:
        up.kill()
        await up.wait()
        raise
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "warmroute", "serve", "--backend", f"up={up_url}", "--port", "0",
        "--strategy", "least_loaded", "--no-engine-metrics",
        "--no-admission",  # the router's own capacity to hold streams: admission would queue all but 32
        "--shutdown-timeout", "5", *router_args, stderr=asyncio.subprocess.PIPE)
    assert router.stderr is not None
    stack = Stack(up, router, "", [d1])
    try:
        stack.url, d2 = await _announced(router, router.stderr)
    except BaseException:
        await stack.close()
        raise
    stack._drains.append(d2)
    return stack


@dataclass
class Tally:
    ok: int = 0
    errors: int = 0
    kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


async def stream_once(session: aiohttp.ClientSession, url: str, i: int, chunks: int, gap: float,
                      tally: Tally) -> None:
    body = {"model": "m", "stream": True, "chunks": chunks, "gap": gap,
            "messages": [{"role": "system", "content": f"client {i} " * 40}, {"role": "user", "content": "go"}]}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            data = await r.read()
            if r.status == 200 and data.endswith(b"data: [DONE]\n\n") and data.count(b"data:") == chunks + 1:
                tally.ok += 1
            else:
                tally.error(f"status_{r.status}" if r.status != 200 else "truncated")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        tally.error(type(exc).__name__)


def client_session(clients: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=300))


async def wave(url: str, clients: int, chunks: int, gap: float) -> Tally:
    """`clients` concurrent streams, each held chunks x gap seconds."""
    tally = Tally()
    async with client_session(clients) as s:
        await asyncio.gather(*(stream_once(s, url, i, chunks, gap, tally) for i in range(clients)))
    return tally


async def soak(minutes: float, clients: int, chunks: int, gap: float) -> dict:
    raise_fd_limit()
    stack = await start_stack()
    tally = Tally()
    samples: list[tuple[float, int]] = []
    start = time.monotonic()
    end = start + minutes * 60
    warm_until = start + max(20.0, 0.2 * minutes * 60)
    try:
        async with client_session(clients) as s:
            async def client(i: int) -> None:
                n = 0
                while time.monotonic() < end:
                    await stream_once(s, stack.url, i * 1_000_000 + n, chunks, gap, tally)
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
