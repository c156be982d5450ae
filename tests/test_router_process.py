"""`warmroute serve` as a process: it announces its port, serves, and shuts down gracefully on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import aiohttp
from aiohttp import web

CHUNKS = 5


async def _sse_upstream() -> tuple[web.AppRunner, str]:
    async def sse(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(CHUNKS):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.1)
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", sse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _start_router(upstream: str, *extra: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "warmroute", "serve", "--backend", f"a={upstream}", "--port", "0",
        "--shutdown-timeout", "5", *extra, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 20)).decode()
        assert line, "router exited before listening"
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)


async def test_sigterm_lets_in_flight_streams_finish_then_exits_0():
    upstream, url = await _sse_upstream()
    proc, router = await _start_router(url)
    try:
        async with aiohttp.ClientSession() as client:
            async with client.post(router + "/v1/completions", json={"model": "m", "prompt": "hi"}) as r:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")
                proc.send_signal(signal.SIGTERM)
                rest = await asyncio.wait_for(r.content.read(), 5)
            assert rest.count(b"data:") == CHUNKS - 1  # the stream finished after the signal
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await upstream.cleanup()


async def test_workers_share_the_port_and_stop_together():
    upstream, url = await _sse_upstream()
    proc, router = await _start_router(url, "--workers", "2")
    try:
        async with aiohttp.ClientSession() as client:
            for _ in range(4):
                async with client.post(router + "/v1/completions", json={"model": "m", "prompt": "hi"}) as r:
                    assert r.status == 200 and (await r.read()).count(b"data:") == CHUNKS
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await upstream.cleanup()
