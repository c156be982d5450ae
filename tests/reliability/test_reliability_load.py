"""Load: 2,000 concurrent streaming clients held about 20 s through one router process on loopback, with no
errors and flat memory. The harness (trivial instance process, router process, clients) is
warmroute.bench.stream_load, which benchmarks/soak.py also drives for the opt-in multi-minute soak
(`benchmarks/soak.py --minutes 10`)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from warmroute.bench import stream_load as soak
from warmroute.prometheus_text import read_samples

CLIENTS = 2000


async def _inflight(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return int(sum(v for _, v in read_samples(text, ("warmroute_inflight",)).get("warmroute_inflight", [])))


@pytest.mark.slow
async def test_2000_concurrent_streams_no_errors_flat_memory():
    assert soak.raise_fd_limit() >= 2 * CLIENTS + 200
    stack = await soak.start_stack(itl_ms=1000)
    try:
        warm = await soak.wave(stack.url, CLIENTS, chunks=3)  # connections, buffers, caches warm
        assert warm.errors == 0, warm.kinds
        rss_before = soak.rss_kib(stack.router.pid)
        start = time.monotonic()
        held = asyncio.ensure_future(soak.wave(stack.url, CLIENTS, chunks=21))  # 20 s
        peak_inflight = 0
        while not held.done():
            await asyncio.sleep(2)
            if not held.done():
                peak_inflight = max(peak_inflight, await _inflight(stack.url))
        tally = await held
        took = time.monotonic() - start
        rss_after = soak.rss_kib(stack.router.pid)
    finally:
        await stack.close()
    assert tally.errors == 0 and tally.ok == CLIENTS, tally.kinds
    assert peak_inflight >= CLIENTS * 0.99  # all of them were open at once
    growth = (rss_after - rss_before) / rss_before
    assert growth < 0.05, (rss_before, rss_after)
    print(f"\n{CLIENTS} streams held {took:.1f}s: ok={tally.ok} errors={tally.errors} peak in flight "
          f"{peak_inflight}; router RSS {rss_before / 1024:.1f} -> {rss_after / 1024:.1f} MiB "
          f"({100 * growth:+.2f}%)")


async def test_the_router_stays_live_with_4096_requests_waiting():
    """#33: the admission queue at its default bound (4,096 waiting), nothing completing: /livez answers within
    50 ms and the router uses under half a core (before, every waiter polled the whole queue every 0.25 s: /livez
    took 6.5 s at p50 and the router a whole core; benchmarks/queue_livez.py)."""
    assert soak.raise_fd_limit() >= 2 * 4096 + 200
    stack = await soak.start_stack(10_000, "--engine-capacity", "1", "--queue-timeout", "600", admission=True)
    try:
        got = await soak.livez_with_queue(stack, 4096, probes=20)
    finally:
        await stack.close()
    assert got.waiting == 4096
    assert max(got.livez_ms) < 50, got.livez_ms
    assert got.router_cores < 0.5
