"""Instance faults over real HTTP on 127.0.0.1: an instance killed mid-stream, one that accepts connections and
never answers, one that drops the connection before answering. Whatever fails, a client gets a clean error or
a cut connection (never a hang), and no request that could have gone elsewhere is lost.

Measured outcomes of these tests are in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from fake_upstream import CHAT, Upstream, router_for
from warmroute.bench.processes import Child, free_ports
from warmroute.prometheus_text import read_samples
from warmroute.router.app import ROUTER

# A trivial instance in its own process, so it can really be killed (SIGKILL: no FIN handshake niceties, no
# graceful shutdown): streams of STREAM_TOKENS tokens 50 ms apart, /health 200.
STREAM_TOKENS = 40


async def _spawn_killable(port: int, logs: Path) -> Child:
    proc = Child("killable", ["--port", str(port), "--itl-ms", "50"], logs, module="warmroute.bench.trivial")
    try:
        await proc.wait_for_log("listening on", 1, timeout_s=20)
    except BaseException:
        proc.stop()
        raise
    return proc


async def _until(cond, timeout: float) -> float:
    """Seconds until `cond()` holds (AssertionError after `timeout`)."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def _sse_upstream(name: str) -> Upstream:
    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            await resp.write(b'data: {"i": %d}\n\n' % i)
            await asyncio.sleep(0.02)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    up = await Upstream(name).start()
    up.behaviour = sse
    return up


@pytest.mark.slow
async def test_instance_killed_mid_stream(tmp_path):
    """SIGKILL an instance with streams open: those clients see a cut connection within a second; requests
    sent after the kill all go to the survivor (none lost); the instance is ejected within one health
    interval and taken back within one interval of coming back on the same port."""
    interval = 0.5
    port = free_ports(1)
    proc = await _spawn_killable(port, tmp_path)
    b = await _sse_upstream("b")
    a_url = f"http://127.0.0.1:{port}"
    router = await router_for(b, backends=[f"a={a_url}", f"b={b.url}"], strategy="round_robin",
                              health_interval=interval, health_timeout=0.3)
    fleet = router.app[ROUTER].fleet
    try:
        async with aiohttp.ClientSession() as client:
            # Four streams, round robin: two on each instance.
            stream = {**CHAT, "stream": True, "max_tokens": STREAM_TOKENS}
            streams = [await client.post(router.url + "/v1/chat/completions", json=stream) for _ in range(4)]
            on_a = [r for r in streams if r.headers["x-warmroute-instance"] == "a"]
            assert len(on_a) == 2
            for r in on_a:
                await r.content.readuntil(b"\n\n")  # the stream is flowing
            proc.signal_group(signal.SIGKILL)
            killed_at = time.monotonic()
            ejected = asyncio.ensure_future(_until(lambda: not fleet.instances["a"].healthy, interval + 0.5))
            await asyncio.to_thread(proc.proc.wait, 5)

            cut = 0
            for r in on_a:  # a cut connection, surfaced fast: never a hang, never a clean end
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(r.content.read(), 2)
                cut += 1
            error_seen_s = time.monotonic() - killed_at
            for r in streams:
                if r not in on_a:
                    assert (await r.read()).endswith(b"data: [DONE]\n\n")
                r.release()

            # Requests not yet sent: all answered, by b (a refused connection is retried once elsewhere).
            async def one() -> tuple[int, str]:
                async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                    await r.read()
                    return r.status, r.headers.get("x-warmroute-instance", "")
            results = await asyncio.gather(*(one() for _ in range(20)))
            lost = sum(1 for status, _ in results if status != 200)
            assert lost == 0 and {inst for _, inst in results} == {"b"}

            eject_s = await ejected  # measured from the kill
            assert eject_s <= interval + 0.2

            # Back on the same port: taken back by the next health check.
            proc = await _spawn_killable(port, tmp_path)
            restarted_at = time.monotonic()
            recover_s = await _until(lambda: fleet.instances["a"].healthy, interval + 1.0)
            results = await asyncio.gather(*(one() for _ in range(6)))
            assert all(s == 200 for s, _ in results) and "a" in {i for _, i in results}
        print(f"\nkill: streams cut={cut} error_after={error_seen_s:.3f}s lost={lost} "
              f"ejected_within={eject_s:.3f}s recovered_after={recover_s:.3f}s (interval {interval}s) "
              f"since_restart={time.monotonic() - restarted_at:.3f}s")
    finally:
        proc.stop()
        await router.stop()
        await b.stop()


async def test_dead_instance_is_ejected_by_the_health_check_alone():
    """No traffic at all: the active check alone ejects a dead instance within one interval."""
    interval = 0.3
    a, b = await Upstream("a").start(), await Upstream("b").start()
    router = await router_for(a, b, health_interval=interval, health_timeout=0.2)
    fleet = router.app[ROUTER].fleet
    try:
        await a.stop()  # its port now refuses connections
        eject_s = await _until(lambda: not fleet.instances["a"].healthy, interval + 0.3)
        assert eject_s <= interval + 0.3
        print(f"\nhealth-check ejection after {eject_s:.3f}s (interval {interval}s)")
    finally:
        await router.stop()
        await b.stop()


async def test_silent_instance_first_byte_timeout_is_retried_elsewhere():
    """An instance whose kernel accepts connections but which never reads or answers (a listening socket
    nobody accepts from): the first-byte timeout fires and, as no byte reached the client, the request is
    sent to the other instance. Nothing is lost; the silent one is ejected after its failures."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1024)  # connections complete in the kernel; nobody ever reads them
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    b = await Upstream("b").start()
    router = await router_for(b, backends=[f"a={silent_url}", f"b={b.url}"], strategy="round_robin",
                              first_byte_timeout=0.3, failures_before_ejection=3)
    fleet = router.app[ROUTER].fleet
    fleet.instances["a"].healthy = True  # its first health check timed out once; not yet ejected
    try:
        async with aiohttp.ClientSession() as client:
            statuses, took = [], []
            for _ in range(6):
                start = time.monotonic()
                async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                    body = await r.json()
                    statuses.append(r.status)
                    took.append(time.monotonic() - start)
                    assert r.headers["x-warmroute-instance"] == "b" and body["upstream"] == "b"
            assert statuses == [200] * 6
            assert max(took) < 0.3 + 1.0  # one timeout at most, then the retry
            assert not fleet.instances["a"].healthy  # 3 consecutive failures (health check + timeouts)
            text = await (await client.get(router.url + "/metrics")).text()
            retried = [v for labels, v in read_samples(text, ("warmroute_retries_total",))["warmroute_retries_total"]
                       if labels == {"backend": "a", "kind": "upstream_timeout"}]
            assert len(retried) == 1
        print(f"\nsilent instance: 6/6 answered by b, slowest {max(took):.3f}s (first_byte_timeout 0.3s), "
              f"retried {retried[0]:g}; ejected after 3 consecutive failures (its first health check "
              f"timed out, then 2 first-byte timeouts)")
    finally:
        await router.stop()
        await b.stop()
        silent.close()


async def test_drop_before_answer_is_retried_and_drop_mid_stream_is_a_cut():
    """An instance that closes the connection after reading the request (no status line) is retried
    elsewhere; one that closes it after the first chunk cannot be (bytes reached the client): that client
    sees a truncated stream, at once."""
    a, b = await Upstream("a").start(), await Upstream("b").start()
    mode = {"when": "before"}

    async def rude(request: web.Request) -> web.StreamResponse:
        if mode["when"] == "before":
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"i": 0}\n\n')
        assert request.transport is not None
        request.transport.abort()
        await asyncio.sleep(1)
        return resp

    a.behaviour = rude
    router = await router_for(a, b, strategy="round_robin", failures_before_ejection=100)
    try:
        async with aiohttp.ClientSession() as client:
            answered = []
            for _ in range(4):
                async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                    answered.append((r.status, r.headers["x-warmroute-instance"]))
            assert answered == [(200, "b")] * 4  # every request that went to a was retried on b
            mode["when"] = "after"
            cut = 0
            for _ in range(2):
                async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                    if r.headers["x-warmroute-instance"] == "a":
                        with pytest.raises(aiohttp.ClientPayloadError):
                            await asyncio.wait_for(r.content.read(), 2)
                        cut += 1
            assert cut == 1
    finally:
        await router.stop()
        await a.stop()
        await b.stop()


async def test_5xx_and_429_are_not_retried():
    """An instance that answers (even 500 or 429) has answered: passed through as is, not sent twice."""
    a, b = await Upstream("a").start(), await Upstream("b").start()

    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=int(json.loads(await request.read())["s"]))

    a.behaviour = busy
    router = await router_for(a, b, strategy="round_robin", failures_before_ejection=100)
    try:
        async with aiohttp.ClientSession() as client:
            got = []
            for s in (0, 429, 0, 500, 0, 503):  # round robin starts at b: a gets 429, 500, 503
                async with client.post(router.url + "/v1/chat/completions", json={**CHAT, "s": s}) as r:
                    got.append((r.status, r.headers["x-warmroute-instance"]))
            assert got == [(200, "b"), (429, "a"), (200, "b"), (500, "a"), (200, "b"), (503, "a")]
            assert len(a.seen) == 3  # each sent once
            text = await (await client.get(router.url + "/metrics")).text()
            assert 'warmroute_upstream_errors_total{backend="a",kind="status_5xx"} 2.0' in text
            assert 'warmroute_upstream_errors_total{backend="a",kind="status_429"} 1.0' in text
            assert "warmroute_retries_total{" not in text
    finally:
        await router.stop()
        await a.stop()
        await b.stop()
