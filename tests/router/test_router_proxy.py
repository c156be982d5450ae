"""The router's proxy mechanics against small inline upstreams: bytes, headers, streaming, errors, health.

Each test starts real HTTP servers on 127.0.0.1 with ephemeral ports and stops them at the end. Routing
behaviour against the emulated engine lives in test_router_engine.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web

from fake_upstream import CHAT, DROP, router_for
from warmroute.core.routing_key import key_for_json
from warmroute.router.app import HEALTH, ROUTER, UPSTREAMS

# -- proxying ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": "m", "prompt": "Once upon a time"}),
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"]}),
    ("/v1/completions", {"model": "m", "prompt": [1, 2, 3, 4]}),
    ("/v1/embeddings", {"model": "m", "input": "embed me"}),
    ("/v1/responses", {"model": "m", "input": "hello", "instructions": "be brief"}),
])
async def test_json_routes_are_forwarded_byte_for_byte(up_a, client, path, body):
    router = await router_for(up_a)
    try:
        raw = json.dumps(body, indent=1).encode()  # odd formatting: forwarded as is, not re-serialised
        async with client.post(router.url + path + "?x=1", data=raw,
                               headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200
            assert (await r.json())["path"] == path
            assert r.headers["x-warmroute-instance"] == "a"
            assert r.headers["x-warmroute-reason"]
        method, path_qs, _, got = up_a.seen[-1]
        assert (method, path_qs, got) == ("POST", path + "?x=1", raw)
    finally:
        await router.stop()


async def test_invocations_and_ping(up_a, client):
    router = await router_for(up_a)
    try:
        raw = b"\x00\x01 not json at all" * 100
        async with client.post(router.url + "/invocations", data=raw) as r:
            assert r.status == 200 and (await r.json())["bytes"] == len(raw)
        assert up_a.seen[-1][3] == raw
        async with client.get(router.url + "/ping") as r:
            assert r.status == 200
    finally:
        await router.stop()


async def test_headers_pass_both_ways_minus_hop_by_hop(up_a, client):
    async def answer(request: web.Request) -> web.Response:
        return web.Response(text="x", headers={"X-Custom": "down", "Proxy-Authenticate": "Basic",
                                               "Keep-Alive": "timeout=5", "Set-Cookie": "s=1",
                                               "x-warmroute-instance": "spoofed"})

    up_a.behaviour = answer
    router = await router_for(up_a)
    try:
        headers = {"Authorization": "Bearer sk-test", "X-Custom": "up", "Keep-Alive": "timeout=1",
                   "Proxy-Authorization": "secret", "TE": "trailers", "Connection": "keep-alive, X-Hop",
                   "X-Hop": "1", "Host": "evil.example:1234", "Content-Type": "application/json"}
        async with client.post(router.url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
            assert r.status == 200
            assert r.headers["X-Custom"] == "down"
            assert r.headers["Set-Cookie"] == "s=1"
            assert "Proxy-Authenticate" not in r.headers and "Keep-Alive" not in r.headers
            assert r.headers["x-warmroute-instance"] == "a"  # ours, not the upstream's
            assert r.headers["Content-Length"] == "1"
        seen = {k.lower(): v for k, v in up_a.seen[-1][2].items()}
        assert seen["authorization"] == "Bearer sk-test" and seen["x-custom"] == "up"
        for hop in ("keep-alive", "proxy-authorization", "te", "x-hop"):
            assert hop not in seen, hop
        assert seen["host"] == f"127.0.0.1:{up_a.port}"  # the client cannot name the upstream host
    finally:
        await router.stop()


async def test_client_named_addresses_are_ignored(up_a, client):
    router = await router_for(up_a)
    try:
        async with client.post(router.url + "/tokenize", headers={"Host": "evil.example",
                                                                   "X-Forwarded-Host": "evil"}) as r:
            assert r.status == 200
        assert up_a.seen[-1][1] == "/tokenize"  # the request went to the configured instance

        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)  # absolute-form target
        writer.write(b"GET http://evil.example/tokenize?q=1 HTTP/1.1\r\nHost: evil.example\r\n"
                     b"Connection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
        assert up_a.seen[-1][1] == "/tokenize?q=1"
    finally:
        await router.stop()


async def test_decision_headers_can_be_switched_off(up_a, client):
    router = await router_for(up_a, decision_headers=False)
    try:
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
            assert "x-warmroute-instance" not in r.headers and "x-warmroute-reason" not in r.headers
    finally:
        await router.stop()


async def test_unrouted_inference_paths_go_to_the_least_loaded_instance(up_a, up_b, client):
    router = await router_for(up_a, up_b)
    try:
        router.app[ROUTER].fleet.instances["a"].inflight = 5  # pretend a is busy
        async with client.post(router.url + "/tokenize?q=1", json={"prompt": "x"}) as r:
            assert r.status == 200
            assert r.headers["x-warmroute-instance"] == "b"
            assert r.headers["x-warmroute-reason"] == "load_balance"
        assert up_b.seen[-1][:2] == ("POST", "/tokenize?q=1")
    finally:
        await router.stop()


# -- streaming -----------------------------------------------------------------------------------------------
async def test_stream_chunks_arrive_before_the_upstream_finishes(up_a, client):
    release = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"n": 1}\n\n')
        await asyncio.wait_for(release.wait(), 5)  # the rest only once the client has seen chunk 1
        for n in (2, 3):
            await resp.write(f'data: {{"n": {n}}}\n\n'.encode())
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    up_a.behaviour = sse
    router = await router_for(up_a)
    try:
        async with client.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.headers["Content-Type"] == "text/event-stream"
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 2)
            assert first == b'data: {"n": 1}\n\n'
            release.set()
            rest = await asyncio.wait_for(r.content.read(), 2)
        assert rest == b'data: {"n": 2}\n\ndata: {"n": 3}\n\ndata: [DONE]\n\n'
        fleet = router.app[ROUTER].fleet
        assert fleet.instances["a"].inflight == 0
    finally:
        await router.stop()


async def test_the_kv_demand_in_flight_is_on_the_books_and_in_metrics(up_a, client):
    """While a request is in flight its prompt tokens count against its instance (the KV cache it needs), in the
    fleet's books and in warmroute_inflight_prompt_tokens; both return to 0 when it is done."""
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await asyncio.wait_for(release.wait(), 5)
        return web.json_response({"choices": []})

    up_a.behaviour = slow
    router = await router_for(up_a)
    fleet = router.app[ROUTER].fleet
    expected = key_for_json("/v1/chat/completions", CHAT).tokens
    try:
        sent = asyncio.ensure_future(client.post(router.url + "/v1/chat/completions", json=CHAT))
        await _until(lambda: fleet.instances["a"].inflight == 1)
        assert fleet.instances["a"].inflight_prompt_tokens == expected > 0
        async with client.get(router.url + "/metrics") as r:
            assert f'warmroute_inflight_prompt_tokens{{backend="a"}} {float(expected)}' in await r.text()
        release.set()
        async with await sent as r:
            assert r.status == 200
        await _until(lambda: fleet.instances["a"].inflight == 0)
        assert fleet.instances["a"].inflight_prompt_tokens == 0
        async with client.get(router.url + "/metrics") as r:
            assert 'warmroute_inflight_prompt_tokens{backend="a"} 0.0' in await r.text()
    finally:
        await router.stop()


async def test_large_answers_arrive_whole_through_the_direct_relay(up_a, client, monkeypatch):
    """A 4 MiB answer with a Content-Length and a chunked one, each written in pieces with pauses: the router
    relays most pieces straight from the instance's socket to the client's (proxy._direct_writer), framed as
    the headers it sent say, and the bytes arrive exact."""
    from warmroute.router import proxy

    body = bytes(range(256)) * (4 * 4096)
    direct = []
    make = proxy._direct_writer

    def counting(*args):  # type: ignore[no-untyped-def]
        write = make(*args)
        return lambda data: write(data) and not direct.append(len(data))

    monkeypatch.setattr(proxy, "_direct_writer", counting)

    async def pieces(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        if request.query.get("chunked") != "1":
            resp.content_length = len(body)
        await resp.prepare(request)
        for i in range(0, len(body), 256 * 1024):
            await resp.write(body[i:i + 256 * 1024])
            await asyncio.sleep(0.005)
        await resp.write_eof()
        return resp

    up_a.behaviour = pieces
    router = await router_for(up_a)
    try:
        for chunked in ("0", "1"):
            direct.clear()
            async with client.post(router.url + f"/tokenize?chunked={chunked}", data=b"{}") as r:
                assert r.status == 200 and await r.read() == body
                assert ("Content-Length" in r.headers) == (chunked == "0")
                assert (r.headers.get("Transfer-Encoding") == "chunked") == (chunked == "1")
            assert direct and sum(direct) < len(body)  # most went direct, the first through aiohttp
    finally:
        await router.stop()


async def _endless(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    while True:
        await resp.write(b"data: {}\n\n")
        await asyncio.sleep(0.02)


async def _slow_prefill(request: web.Request) -> web.Response:
    await asyncio.sleep(10)
    return web.Response(text="too late")


async def _leave_mid_stream(client: aiohttp.ClientSession, url: str) -> None:
    async with client.post(url + "/v1/chat/completions", json=CHAT) as r:
        await r.content.readuntil(b"\n\n")
        r.close()


async def _leave_before_first_byte(client: aiohttp.ClientSession, url: str) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await client.post(url + "/v1/chat/completions", json=CHAT, timeout=aiohttp.ClientTimeout(total=0.3))


@pytest.mark.parametrize("behaviour, leave", [(_endless, _leave_mid_stream), (_slow_prefill, _leave_before_first_byte)],
                         ids=["mid_stream", "before_first_byte"])
async def test_a_client_that_leaves_closes_the_upstream(up_a, client, behaviour, leave):
    up_a.behaviour = behaviour
    router = await router_for(up_a)
    try:
        await leave(client, router.url)
        await asyncio.wait_for(up_a.cancelled.wait(), 2)
        await _until(lambda: router.app[ROUTER].fleet.instances["a"].inflight == 0)
    finally:
        await router.stop()


async def test_first_byte_timeout_is_a_504(up_a, client):
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(text="late")

    up_a.behaviour = slow
    router = await router_for(up_a, first_byte_timeout=0.2)
    try:
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 504
            err = (await r.json())["error"]
            assert "first_byte_timeout" in err["message"] and err["type"] == "upstream_timeout"
        await asyncio.wait_for(up_a.cancelled.wait(), 2)  # and the upstream request was abandoned
    finally:
        await router.stop()


async def test_idle_timeout_cuts_the_stream(up_a, client):
    async def stalls(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await asyncio.sleep(5)
        return resp

    up_a.behaviour = stalls
    router = await router_for(up_a, idle_timeout=0.2)
    try:
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):  # truncated, not a clean end
                await asyncio.wait_for(r.content.read(), 2)
    finally:
        await router.stop()


# -- errors the router answers itself --------------------------------------------------------------------------
async def _error_of(r: aiohttp.ClientResponse) -> dict:
    assert r.headers["Content-Type"].startswith("application/json")
    return (await r.json())["error"]


@pytest.mark.parametrize("raw,needle", [
    (b"{not json", "not valid JSON"),
    (b"", "empty"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": "m"}', "messages"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "content"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[" * 100_000, "nested too deeply"),
])
async def test_bad_json_bodies_are_400(up_a, client, raw, needle):
    router = await router_for(up_a)
    try:
        async with client.post(router.url + "/v1/chat/completions", data=raw) as r:
            assert r.status == 400
            err = await _error_of(r)
            assert err["type"] == "invalid_request_error" and needle in err["message"]
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:  # the next one is fine
            assert r.status == 200
        assert not up_a.seen[:-1]  # nothing bad was forwarded
    finally:
        await router.stop()


async def test_oversized_body_is_413(up_a, client):
    router = await router_for(up_a, max_body_bytes="1KiB")
    try:
        big = json.dumps({"model": "m", "prompt": "x" * 5000}).encode()
        async with client.post(router.url + "/v1/completions", data=big) as r:
            assert r.status == 413 and "max_body_bytes" in (await _error_of(r))["message"]

        async def chunks():  # no Content-Length: caught while reading
            for _ in range(10):
                yield b"x" * 500

        async with client.post(router.url + "/v1/completions", data=chunks()) as r:
            assert r.status == 413
        assert not up_a.seen
    finally:
        await router.stop()


async def test_no_healthy_instance_is_503_with_retry_after(up_a, client):
    up_a.health_status = 503
    router = await router_for(up_a)
    try:
        await _until(lambda: not router.app[ROUTER].fleet.instances["a"].healthy)
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503 and r.headers["Retry-After"].isdigit()
            assert (await _error_of(r))["type"] == "service_unavailable"
        for path in ("/health", "/ping"):
            async with client.get(router.url + path) as r:
                assert r.status == 503
    finally:
        await router.stop()


async def test_internal_errors_become_a_json_500_without_traceback(up_a, client, monkeypatch):
    router = await router_for(up_a)
    try:
        def boom(*args, **kwargs):
            raise RuntimeError("secret internals")

        monkeypatch.setattr(router.app[ROUTER], "route", boom)
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 500
            text = await r.text()
            assert "secret internals" not in text and "Traceback" not in text
        monkeypatch.undo()
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
    finally:
        await router.stop()


async def test_upstream_429_and_5xx_pass_through(up_a, client):
    statuses = iter([429, 500])

    async def refuse(request: web.Request) -> web.Response:
        status = next(statuses)
        return web.json_response({"error": {"message": f"upstream says {status}"}}, status=status,
                                 headers={"Retry-After": "7"})

    up_a.behaviour = refuse
    router = await router_for(up_a)
    try:
        for status in (429, 500):
            async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == status and r.headers["Retry-After"] == "7"
                assert (await r.json())["error"]["message"] == f"upstream says {status}"
        text = await (await client.get(router.url + "/metrics")).text()
        assert 'warmroute_requests_total{backend="a",status="429"} 1.0' in text
        assert 'warmroute_upstream_errors_total{backend="a",kind="status_5xx"} 1.0' in text
    finally:
        await router.stop()


# -- health ----------------------------------------------------------------------------------------------------
async def test_failed_health_check_ejects_and_a_passing_one_restores(up_a, up_b, client):
    router = await router_for(up_a, up_b, health_interval=0.05, strategy="round_robin")
    fleet = router.app[ROUTER].fleet
    try:
        up_a.health_status = 500
        await _until(lambda: not fleet.instances["a"].healthy)
        for _ in range(4):
            async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.headers["x-warmroute-instance"] == "b"
        text = await (await client.get(router.url + "/metrics")).text()
        assert 'warmroute_instance_healthy{backend="a"} 0.0' in text
        up_a.health_status = 200
        await _until(lambda: fleet.instances["a"].healthy)
        got = set()
        for _ in range(4):
            async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                got.add(r.headers["x-warmroute-instance"])
        assert got == {"a", "b"}
    finally:
        await router.stop()


async def test_a_connect_timeout_counts_as_one_failure_and_a_refusal_ejects(up_a, up_b):
    """An instance too busy to accept a connection in time is slow, not gone: a timeout counts toward
    failures_before_ejection; a refused connection (nothing listening) ejects at once."""
    router = await router_for(up_a, up_b, health_interval=3600, failures_before_ejection=2)
    health, fleet = router.app[HEALTH], router.app[ROUTER].fleet
    try:
        health.connection_failed("a", "no connection to a within 2 s", timed_out=True)
        assert fleet.instances["a"].healthy
        health.connection_failed("a", "no connection to a within 2 s", timed_out=True)
        assert not fleet.instances["a"].healthy  # two in a row
        health.connection_failed("b", "cannot connect to b: refused")
        assert not fleet.instances["b"].healthy
    finally:
        await router.stop()


async def test_failures_never_eject_the_last_routable_instance(up_a, up_b):
    """Slow is better than none: with the other instance gone, failures keep the last one routable; a refused
    connection (nothing listens there) still ejects it."""
    router = await router_for(up_a, up_b, health_interval=3600, failures_before_ejection=2)
    health, fleet = router.app[HEALTH], router.app[ROUTER].fleet
    try:
        health.connection_failed("b", "cannot connect to b: refused")
        assert not fleet.instances["b"].healthy
        for _ in range(3):
            health.failed("a", "first-byte timeout")
        assert fleet.instances["a"].healthy
        health.connection_failed("a", "cannot connect to a: refused")
        assert not fleet.instances["a"].healthy
    finally:
        await router.stop()


async def test_a_health_check_cut_short_is_one_failure_not_an_ejection(up_a, up_b):
    """A connection dropped before /health answers says the instance is in trouble, not that nothing listens."""
    router = await router_for(up_a, up_b, health_interval=3600, failures_before_ejection=2)
    health, fleet = router.app[HEALTH], router.app[ROUTER].fleet
    try:
        up_a.health_status = DROP
        await health.check_now("a")
        assert fleet.instances["a"].healthy
        await health.check_now("a")
        assert not fleet.instances["a"].healthy  # two in a row
    finally:
        await router.stop()


async def test_consecutive_5xx_eject(up_a, up_b, client):
    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=502, text="bad gateway")

    up_a.behaviour = broken
    router = await router_for(up_a, up_b, strategy="round_robin", failures_before_ejection=2)
    fleet = router.app[ROUTER].fleet
    try:
        seen_a = 0
        for _ in range(8):
            async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                if r.headers["x-warmroute-instance"] == "a":
                    assert r.status == 502
                    seen_a += 1
        assert seen_a == 2 and not fleet.instances["a"].healthy and fleet.instances["b"].healthy
    finally:
        await router.stop()


async def test_connect_failure_is_retried_once_on_the_next_choice(up_a, up_b, client):
    router = await router_for(up_a, up_b, strategy="round_robin")
    fleet = router.app[ROUTER].fleet
    try:
        await up_a.stop()  # a was healthy at start; now its port refuses connections
        for _ in range(4):
            async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200 and r.headers["x-warmroute-instance"] == "b"
        assert not fleet.instances["a"].healthy
        assert all(i.inflight == 0 for i in fleet.instances.values())
        text = await (await client.get(router.url + "/metrics")).text()
        assert 'warmroute_upstream_errors_total{backend="a",kind="connect"} 1.0' in text
    finally:
        await router.stop()


async def test_retry_happens_only_once(up_a, up_b, client):
    router = await router_for(up_a, up_b)
    try:
        await up_a.stop()
        await up_b.stop()
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 502 and "connect" in (await _error_of(r))["message"]
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503  # both are now ejected
    finally:
        await router.stop()


# -- fleet endpoints ---------------------------------------------------------------------------------------------
async def test_models_are_merged_from_healthy_instances(up_a, up_b, client):
    router = await router_for(up_a, up_b)
    try:
        async with client.get(router.url + "/v1/models", headers={"Authorization": "Bearer k"}) as r:
            assert r.status == 200
            ids = [m["id"] for m in (await r.json())["data"]]
        assert sorted(ids) == ["m", "other", "shared"]
        assert up_a.seen[-1][2]["Authorization"] == "Bearer k"
    finally:
        await router.stop()


async def test_metrics_exposes_every_family(up_a, client):
    router = await router_for(up_a)
    try:
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        async with client.post(router.url + "/v1/chat/completions", data=b"nope") as r:
            assert r.status == 400
        async with client.get(router.url + "/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
        for needle in ('warmroute_requests_total{backend="a",status="200"} 1.0',
                       'warmroute_requests_total{backend="none",status="400"} 1.0',
                       'warmroute_inflight{backend="a"} 0.0',
                       'warmroute_inflight_prompt_tokens{backend="a"} 0.0',
                       'warmroute_decisions_total{reason="cold",strategy="cache_aware"} 1.0',
                       "warmroute_matched_prefix_ratio_bucket",
                       'warmroute_time_to_first_byte_seconds_count{backend="a"} 1.0',
                       "warmroute_decision_seconds_count 1.0",
                       "warmroute_index_entries ", "warmroute_index_bytes ",
                       'warmroute_instance_healthy{backend="a"} 1.0'):
            assert needle in text, needle
        async with client.get(router.url + "/health") as r:
            assert r.status == 200 and (await r.json())["healthy_instances"] == 1
    finally:
        await router.stop()


async def test_many_concurrent_streams_keep_the_books_straight(up_a, up_b, client):
    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(3):
            await resp.write(b"data: {}\n\n")
            await asyncio.sleep(0.005)
        return resp

    up_a.behaviour = up_b.behaviour = sse
    router = await router_for(up_a, up_b)
    try:
        async def one(i: int) -> int:
            body = {**CHAT, "messages": [{"role": "user", "content": f"question {i} " * 40}]}
            async with client.post(router.url + "/v1/chat/completions", json=body) as r:
                assert (await r.read()).count(b"data:") == 3
                return r.status

        assert await asyncio.gather(*(one(i) for i in range(64))) == [200] * 64
        fleet = router.app[ROUTER].fleet
        assert all(i.inflight == 0 and i.queued_prefill_tokens == 0 and i.inflight_prompt_tokens == 0
                   for i in fleet.instances.values())
        assert router.app[UPSTREAMS].started
    finally:
        await router.stop()


async def _until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
