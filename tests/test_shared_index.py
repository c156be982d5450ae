"""Index updates shared between router replicas through Redis: the message format, two routers that learn
from each other, and a router whose Redis is down still serving. Needs `redis-server` (Debian: apt-get install
redis-server; .ci/run installs it) and the redis package; skipped, saying which is missing, otherwise."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import aiohttp
import pytest

from client_helpers import StubEngine
from warmroute.router.app import ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings import load_settings
from warmroute.router.shared_index import FORGET, RECORD, pack, unpack

PROMPT = {"model": "m", "messages": [{"role": "system", "content": "shared policy text. " * 300},
                                     {"role": "user", "content": "what now?"}]}


def test_messages_round_trip_and_malformed_ones_are_refused():
    entries = [(RECORD, "gpu-0", [1, 2**64 - 1, 12345]), (FORGET, "é-1", [7])]
    replica, got = unpack(pack(b"12345678", entries))
    assert replica == b"12345678" and got == entries
    for bad in (b"short", pack(b"12345678", entries)[:-3], b"12345678" + bytes([9, 1]) + b"a" + b"\0\0\0\0"):
        with pytest.raises(ValueError):
            unpack(bad)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url():
    pytest.importorskip("redis", reason="the redis package is not installed (pip install 'warmroute[redis]')")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


async def test_replicas_learn_each_others_prefixes(redis_url):
    engines = [await StubEngine(f"gpu-{i}").start() for i in range(4)]
    values = {"backends": [f"{e.name}={e.url}" for e in engines], "port": 0, "health_interval": 3600,
              "engine_metrics": False, "engine_feedback": False, "redis_url": redis_url,
              "redis_channel": f"test:{free_port()}"}
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
            assert a.app[ROUTER].shared.received >= 0 and b.app[ROUTER].fleet.index.entries(first) > 0
    finally:
        for r in (a, b, lone):
            await r.stop()
        for e in engines:
            await e.runner.cleanup()


async def test_a_router_whose_redis_is_down_still_serves():
    pytest.importorskip("redis")
    engine = await StubEngine("gpu-0").start()
    router = await start_router(load_settings({
        "backends": [f"gpu-0={engine.url}"], "port": 0, "health_interval": 3600, "engine_metrics": False,
        "redis_url": f"redis://127.0.0.1:{free_port()}/0"}, env={}))
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
