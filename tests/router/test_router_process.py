"""`warmroute serve` as a process: it announces its port, serves, and shuts down gracefully on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from fake_upstream import Upstream
from warmroute.bench.processes import Child
from warmroute.prometheus_text import read_samples

CHUNKS = 5


async def _sse(request: web.Request) -> web.StreamResponse:
    """An event every 0.1 s, as many as the body's `chunks` (default CHUNKS)."""
    chunks = json.loads(await request.read()).get("chunks", CHUNKS)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(chunks):
        await resp.write(f"data: {i}\n\n".encode())
        await asyncio.sleep(0.1)
    return resp


@contextlib.asynccontextmanager
async def _router_over_upstream(*extra: str) -> AsyncIterator[tuple[Child, str]]:
    """A router process in front of one streaming upstream; both gone afterwards (the router's workers too: it
    runs in a process group of its own), whatever happened."""
    upstream = await Upstream("a", models=None).start()
    upstream.behaviour = _sse
    try:
        with tempfile.TemporaryDirectory(prefix="warmroute-router-process-") as logs:
            with Child("router", ["serve", "--backend", f"a={upstream.url}", "--port", "0", "--shutdown-timeout",
                                  "5", *extra], Path(logs)) as proc:
                yield proc, await proc.wait_for_url(timeout_s=20)
    finally:
        await upstream.stop()


async def test_sigterm_lets_in_flight_streams_finish_then_exits_0():
    async with _router_over_upstream() as (proc, router):
        async with aiohttp.ClientSession() as client:
            async with client.post(router + "/v1/completions", json={"model": "m", "prompt": "hi"}) as r:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")
                proc.proc.send_signal(signal.SIGTERM)
                rest = await asyncio.wait_for(r.content.read(), 5)
            assert rest.count(b"data:") == CHUNKS - 1  # the stream finished after the signal
        assert await proc.exited(10) == 0


async def test_sigterm_stops_accepting_and_cuts_streams_at_the_deadline():
    """After SIGTERM no new connection is accepted; a stream still running past shutdown_timeout is cut (the
    client sees a truncated response, not a hang); the process exits 0 right after."""
    async with _router_over_upstream("--shutdown-timeout", "1") as (proc, router):  # the last flag wins
        port = int(router.rsplit(":", 1)[1])
        async with aiohttp.ClientSession() as client:
            async with client.post(router + "/v1/completions", json={"model": "m", "prompt": "hi", "chunks": 100}) as r:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")
                proc.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                await asyncio.sleep(0.3)
                with pytest.raises(OSError):  # the listening socket is closed: refused
                    await asyncio.open_connection("127.0.0.1", port)
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(r.content.read(), 5)
                cut_after = time.monotonic() - signalled
        assert await proc.exited(5) == 0
        exited_after = time.monotonic() - signalled
        assert 0.9 <= cut_after <= 1.5 and exited_after <= 2.5, (cut_after, exited_after)
        print(f"\nSIGTERM: stream cut after {cut_after:.2f}s (deadline 1 s), exit 0 after {exited_after:.2f}s")


async def test_workers_share_the_port_and_stop_together():
    async with _router_over_upstream("--workers", "2") as (proc, router):
        async with aiohttp.ClientSession() as client:
            for _ in range(4):
                async with client.post(router + "/v1/completions", json={"model": "m", "prompt": "hi"}) as r:
                    assert r.status == 200 and (await r.read()).count(b"data:") == CHUNKS
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.exited(10) == 0


async def _until_every_worker_reads(router: str, names: tuple[str, ...], reading, want: tuple, workers: int = 2):
    """Scrape until each of the workers has answered /metrics with `want` (`/livez` and `/metrics` on one keep-alive
    connection come from the same worker); fail after 20 s naming the latest reading of each."""
    readings: dict[int, tuple] = {}  # worker pid -> its latest reading
    deadline = time.monotonic() + 20
    while len(readings) < workers or any(v != want for v in readings.values()):
        assert time.monotonic() < deadline, f"readings per worker pid: {readings}, want {want}"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as client:
            async with client.get(router + "/livez") as r:
                pid = (await r.json())["pid"]
            async with client.get(router + "/metrics") as r:
                text = await r.text()
        readings[pid] = reading(read_samples(text, names))
        await asyncio.sleep(0.05)


async def test_workers_share_their_index_and_their_metrics():
    """Two worker processes: every prompt is recorded by whichever worker routed it, and the other learns it
    through the local sockets, so both report the whole index; and /metrics counts every worker's requests,
    whichever worker answers the scrape (`/livez` and `/metrics` on one keep-alive connection come from the
    same worker)."""
    prompts = 12
    async with _router_over_upstream("--workers", "2", "--no-engine-metrics") as (proc, router):
        for i in range(prompts):  # a fresh connection each: the kernel hands them to either worker
            async with aiohttp.ClientSession() as client:
                body = {"model": "m", "prompt": f"doc {i:02d} " + "x" * 633, "chunks": 1}  # 10 blocks of 64 bytes
                async with client.post(router + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
        def entries_and_answered(samples: dict) -> tuple[float, float]:
            entries = sum(v for _, v in samples["warmroute_index_entries"])
            answered = sum(v for labels, v in samples["warmroute_requests_total"] if labels.get("status") == "200")
            return entries, answered

        await _until_every_worker_reads(router, ("warmroute_index_entries", "warmroute_requests_total"),
                                        entries_and_answered, (prompts * 10.0, float(prompts)))
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.exited(10) == 0


async def test_workers_sum_their_demand_and_ask_for_the_fleets_instances():
    """Eight streams held open through two workers (each takes those the kernel hands it): whichever worker answers
    the scrape, the decode dimension is the eight over the one instance's threshold of 16, the demand ratio is that
    sum's highest dimension, and the desired instances are the HPA formula on it, not on the workers' own shares."""
    streams = 8
    flags = ("--workers", "2", "--no-engine-metrics", "--concurrency-threshold", "16", "--scale-target", "0.1")
    async with _router_over_upstream(*flags) as (proc, router):
        sessions = [aiohttp.ClientSession() for _ in range(streams)]  # a connection each: either worker
        try:
            for client in sessions:
                r = await client.post(router + "/v1/completions", json={"model": "m", "prompt": "hi", "chunks": 300})
                assert r.status == 200
                await r.content.readuntil(b"\n\n")  # routed and streaming: in flight until the end
            def decode_ratio_and_desired(samples: dict) -> tuple[float, float, float]:
                decode = sum(v for labels, v in samples["warmroute_fleet_utilization"]
                             if labels["dimension"] == "decode")
                (_, ratio), = samples["warmroute_fleet_demand_ratio"]
                (_, desired), = samples["warmroute_desired_instances"]
                return decode, ratio, desired

            names = ("warmroute_fleet_utilization", "warmroute_fleet_demand_ratio", "warmroute_desired_instances")
            await _until_every_worker_reads(router, names, decode_ratio_and_desired,
                                            (streams / 16, streams / 16, 5.0))  # ceil(1 x 0.5 / 0.1)
        finally:
            for client in sessions:
                await client.close()
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.exited(10) == 0


async def test_workers_show_one_dashboard():
    """Two workers: /dashboard/state counts every worker's requests, hot prefixes (labelled alike) and decisions,
    whichever worker answers (each sends the other a snapshot every second). Without the snapshots each
    worker showed its own share only."""
    prompts = 12
    async with _router_over_upstream("--workers", "2", "--no-engine-metrics") as (proc, router):
        for i in range(prompts):  # a fresh connection each: the kernel hands them to either worker
            async with aiohttp.ClientSession() as client:
                body = {"model": "m", "prompt": f"doc {i % 3} " + "x" * 2000, "chunks": 1}  # 3 prefixes
                async with client.post(router + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
        views: dict[int, dict] = {}  # worker pid -> its latest /dashboard/state
        deadline = time.monotonic() + 20

        def whole(v: dict) -> bool:
            return (v["workers"] == 2 and sum(i["requests"] for i in v["instances"]) == prompts
                    and len(v["recent_decisions"]) == prompts and len(v["hot_prefixes"]) == 3)

        while len(views) < 2 or not all(whole(v) for v in views.values()):
            assert time.monotonic() < deadline, {pid: (v["workers"], [i["requests"] for i in v["instances"]],
                                                       len(v["recent_decisions"])) for pid, v in views.items()}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as client:
                async with client.get(router + "/livez") as r:
                    pid = (await r.json())["pid"]
                async with client.get(router + "/dashboard/state") as r:
                    views[pid] = await r.json()
            await asyncio.sleep(0.05)
        a, b = views.values()
        assert a["hot_prefixes"] == b["hot_prefixes"]  # the same ids and shares from either worker
        assert sorted(p["share"] for p in a["hot_prefixes"]) == [0.3333, 0.3333, 0.3333]
        proc.proc.send_signal(signal.SIGTERM)
        assert await proc.exited(10) == 0
