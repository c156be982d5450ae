"""Index updates shared between router replicas through Redis: the message format, two routers that learn
from each other, and a router whose Redis is down still serving. Needs `redis-server` (Debian: apt-get install
redis-server; .ci/run installs it) and the redis package; skipped, saying which is missing, otherwise.
Between the workers of one router (local sockets, no Redis): here in one process; as real worker processes in
tests/router/test_router_process.py."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from fake_upstream import Upstream
from warmroute.bench.processes import free_ports
from warmroute.core.block_hash import block_hashes
from warmroute.router.app import ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings
from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.router.shared_index import FORGET, MAX_LINK_BLOCKS, RECORD, WorkerLinks, pack, unpack, worker_links

PROMPT = {"model": "m", "messages": [{"role": "system", "content": "shared policy text. " * 300},
                                     {"role": "user", "content": "what now?"}]}


def test_messages_round_trip_and_malformed_ones_are_refused():
    entries = [(RECORD, "gpu-0", [1, 2**64 - 1, 12345]), (FORGET, "é-1", [7])]
    replica, got = unpack(pack(b"12345678", entries))
    assert replica == b"12345678" and [(op, name, list(blocks)) for op, name, blocks in got] == entries
    # A Chain (block_hash's) is packed from its words as they are: the same bytes as from its list of ints.
    chain = block_hashes(b"shared index words " * 40, 3)
    assert pack(b"12345678", [(RECORD, "a", chain)]) == pack(b"12345678", [(RECORD, "a", list(chain))])
    assert list(unpack(pack(b"12345678", [(RECORD, "a", chain)]))[1][0][2]) == list(chain)
    for bad in (b"short", pack(b"12345678", entries)[:-3], b"12345678" + bytes([9, 1]) + b"a" + b"\0\0\0\0"):
        with pytest.raises(ValueError):
            unpack(bad)


async def test_replicas_learn_each_others_prefixes(redis_url):
    engines = [await Upstream(f"gpu-{i}", models=None).start() for i in range(4)]
    values = {"backends": [f"{e.name}={e.url}" for e in engines], "port": 0, "health_interval": 3600,
              "engine_metrics": False, "engine_feedback": False, "redis_url": redis_url,
              "redis_channel": f"test:{free_ports(1)}"}
    a = await start_router(load_settings(values, env={}))
    b = await start_router(load_settings(values, env={}))
    lone = await start_router(load_settings({**values, "redis_url": None}, env={}))
    try:
        async with aiohttp.ClientSession() as client:
            async def ask(router, body=PROMPT):
                async with client.post(router.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    return r.headers["x-warmroute-instance"], r.headers["x-warmroute-reason"]

            first, reason = await ask(a)
            assert reason == "cold"
            shared_b = b.app[ROUTER].shared
            deadline = time.monotonic() + 5
            while shared_b.received == 0:
                assert time.monotonic() < deadline, "router b never heard of router a's decision"
                await asyncio.sleep(0.02)
            assert await ask(b) == (first, "cache_hit")  # b knows where a put the prefix
            assert (await ask(lone))[1] == "cold"  # a replica without Redis does not
            assert b.app[ROUTER].fleet.index.entries(first) > 0
            while a.app[ROUTER].shared.received == 0:  # and a hears b's decision in turn
                assert time.monotonic() < deadline + 5, "router a never heard of router b's decision"
                await asyncio.sleep(0.02)
    finally:
        for r in (a, b, lone):
            await r.stop()
        for e in engines:
            await e.runner.cleanup()


async def test_a_router_whose_redis_is_down_still_serves():
    pytest.importorskip("redis")
    engine = await Upstream("gpu-0", models=None).start()
    router = await start_router(load_settings({
        "backends": [f"gpu-0={engine.url}"], "port": 0, "health_interval": 3600, "engine_metrics": False,
        "redis_url": f"redis://127.0.0.1:{free_ports(1)}/0"}, env={}))
    try:
        async with aiohttp.ClientSession() as client:
            async with client.post(router.url + "/v1/chat/completions", json=PROMPT) as r:
                assert r.status == 200
    finally:
        await router.stop()
        await engine.runner.cleanup()


def test_redis_url_is_checked_and_kept_secret():
    from warmroute.errors import UsageError

    with pytest.raises(UsageError, match="redis_url"):
        load_settings({"backends": ["http://127.0.0.1:1"], "redis_url": "http://x"}, env={})
    s = load_settings({"backends": ["http://127.0.0.1:1"], "redis_url": "redis://:pw@127.0.0.1:6379/0"}, env={})
    assert "pw" not in repr(s)


@contextlib.asynccontextmanager
async def linked_workers(count: int, share_index: bool = True):  # type: ignore[no-untyped-def]
    """`count` workers' fleets (instances gpu-0, gpu-1) and links, as `warmroute serve --workers` makes them."""
    links = worker_links(count)
    fleets = [Fleet(FleetSettings()) for _ in range(count)]
    for fleet in fleets:
        for name in ("gpu-0", "gpu-1"):
            fleet.add(name, 1 << 22)
    workers = [WorkerLinks(fleet, links, i, share_index=share_index) for i, fleet in enumerate(fleets)]
    for w in workers:
        await w.start()
    try:
        yield links, fleets, workers
    finally:
        for w in workers:
            await w.stop()
        for pair in links:
            for sock in pair:
                sock.close()


async def test_workers_learn_each_others_updates_through_local_sockets():
    async with linked_workers(3) as (links, fleets, workers):
        chain = list(range(1, 41))
        long_chain = list(range(10**6, 10**6 + MAX_LINK_BLOCKS + 500))  # longer than one datagram may carry
        workers[0].recorded("gpu-1", chain)
        workers[0].recorded("gpu-0", long_chain)
        workers[0].recorded("nobody-here", [7, 8, 9])  # an instance the others do not have: skipped
        await _until(lambda: workers[1].received == 2 and workers[2].received == 2)
        for fleet in fleets[1:]:
            assert fleet.index.match_depths(chain) == {"gpu-1": 40}
            assert fleet.index.match_depths(long_chain) == {"gpu-0": MAX_LINK_BLOCKS}  # its head
        assert workers[0].received == 0  # nobody echoes a worker's own updates back to it

        workers[2].forgotten("gpu-1", chain)
        await _until(lambda: workers[1].received == 3)
        assert fleets[1].index.match_depths(chain) == {} and fleets[0].index.match_depths(chain) == {}
        links[1][1].send(b"garbage, not a message")  # neither kind of datagram: ignored
        links[1][1].send(b"\x00garbage index update")  # a malformed index update: ignored with a warning
        workers[0].recorded("gpu-0", chain)
        await _until(lambda: workers[1].received == 4)
        assert fleets[1].index.match_depths(chain) == {"gpu-0": 40} and workers[0].dropped == 0


async def _until(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the update never arrived"
        await asyncio.sleep(0.01)


async def test_worker_links_carry_dashboard_snapshots_and_with_redis_only_those():
    """With redis_url the workers share the index through Redis: their local sockets then carry only the
    dashboard's snapshots (a second kind of datagram), never index updates."""
    async with linked_workers(2, share_index=False) as (_, fleets, workers):
        got: list[bytes] = []
        workers[1].on_snapshot = got.append
        workers[0].recorded("gpu-0", list(range(1, 41)))
        workers[0].send_snapshot(b'{"pid": 1}')
        await _until(lambda: got == [b'{"pid": 1}'])
        await asyncio.sleep(0.05)
        assert workers[1].received == 0 and fleets[1].index.entries() == 0
