"""Security properties over real HTTP: the upstream is always a configured backend whatever the client names;
what a client sees names instances, never their addresses; logs never hold prompt text; the admin token is
compared in constant time and never logged. (The admin API's own 401s and its absence without a token:
tests/router/test_discovery.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import aiohttp
import pytest
from aiohttp import web

from fake_upstream import CHAT, JSON_TYPE, Upstream, router_for
from warmroute.bench.processes import free_ports
from warmroute.router import auth

MARKER = "zq-PROMPT-MARKER-7781"
TOKEN = "tok-3f9a1c-secret"


@pytest.fixture
async def trap():
    """An instance nobody configured: it must never be reached."""
    up = await Upstream("trap").start()
    yield up
    await up.stop()


async def _raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def test_upstream_is_always_a_configured_backend(trap):
    good = await Upstream("a").start()
    router = await router_for(good)
    evil = f"127.0.0.1:{trap.port}"
    try:
        async with aiohttp.ClientSession(headers=JSON_TYPE) as client:
            named = [  # every way a client might name a destination
                {"Host": evil}, {"X-Forwarded-Host": evil}, {"Forwarded": f"host={evil};proto=http"},
                {"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1"}, {"X-Original-URL": f"http://{evil}/"},
                {"X-Rewrite-URL": f"http://{evil}/"}, {"X-Forwarded-Server": evil},
            ]
            for headers in named:
                async with client.post(router.url + "/v1/chat/completions", json=CHAT, headers=headers) as r:
                    assert r.status == 200 and (await r.json())["upstream"] == "a"
            for field in ("base_url", "api_base", "url", "endpoint", "host", "server"):  # JSON fields
                body = {**CHAT, field: f"http://{evil}/v1"}
                async with client.post(router.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200 and (await r.json())["upstream"] == "a"
            for path in (f"//{evil}/v1/models", f"/@{evil}/x", f"/..//{evil}/x", f"/%2F%2F{evil}/x"):
                async with client.get(router.url + path) as r:
                    assert r.status == 404  # outside the inference API: never forwarded anywhere
        for target in (f"http://{evil}/v1/chat/completions", f"http://{evil}:80@127.0.0.1/x", f"//{evil}/x"):
            body = json.dumps(CHAT).encode()
            answer = await _raw(router.port, f"POST {target} HTTP/1.1\r\nHost: {evil}\r\nConnection: close\r\n"
                                             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert answer.startswith((b"HTTP/1.1 200", b"HTTP/1.1 400", b"HTTP/1.1 404")), answer[:80]
        answer = await _raw(router.port, f"CONNECT {evil} HTTP/1.1\r\nHost: {evil}\r\nConnection: close\r\n\r\n"
                            .encode())
        assert not answer.startswith(b"HTTP/1.1 200 Connection established")
        assert trap.seen == []  # never reached
        assert good.seen and all(h["Host"] == f"127.0.0.1:{good.port}" for _, _, h, _ in good.seen)
    finally:
        await router.stop()
        await good.stop()


async def test_clients_see_instance_names_never_addresses():
    """Decision headers, router-made errors (connect failure, timeout, no instance), /health, /metrics and
    /dashboard/state name instances; no address or port of an instance appears in any of them."""
    a = await Upstream("a").start()

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2)
        return web.Response(text="late")

    dead_port = free_ports(1)  # a port nobody listens on
    router = await router_for(a, backends=[f"a={a.url}", f"dead=http://127.0.0.1:{dead_port}"],
                              first_byte_timeout=0.2, strategy="round_robin")
    addresses = (str(a.port), str(dead_port))
    seen_texts: list[str] = []
    try:
        async with aiohttp.ClientSession(headers=JSON_TYPE) as client:
            async def visit(method: str, path: str, **kw) -> aiohttp.ClientResponse:
                async with client.request(method, router.url + path, **kw) as r:
                    seen_texts.append(json.dumps(dict(r.headers)) + await r.text())
                    return r
            for _ in range(3):
                await visit("POST", "/v1/chat/completions", json=CHAT)
            a.behaviour = slow
            r = await visit("POST", "/v1/chat/completions", json=CHAT)  # 504 (dead is ejected: no retry)
            assert r.status == 504 and r.headers["x-warmroute-instance"] == "a"
            for path in ("/health", "/metrics", "/dashboard/state", "/v1/models"):
                await visit("GET", path)
        for text in seen_texts:
            for port in addresses:
                # A whole number, not digits inside another one (/metrics is full of long floats and timestamps,
                # which contained a 5-digit port by chance once in a full run).
                assert not re.search(rf"(?<![\d.]){port}(?![\d.])", text), text[:300]
    finally:
        await router.stop()
        await a.stop()


async def test_logs_never_contain_prompt_text(caplog):
    """Debug logging on everywhere; requests carrying a marker in their prompt through every path that logs:
    success, a stream cut mid-way, a first-byte timeout, an upstream 500, a bad body, an internal error, a
    malformed HTTP message whose body is read as the next request line. The marker appears in no record."""
    a = await Upstream("a").start()
    mode = {"kind": "ok"}

    async def behave(request: web.Request) -> web.StreamResponse:
        if mode["kind"] == "cut":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: {}\n\n")
            assert request.transport is not None
            request.transport.abort()
            return resp
        if mode["kind"] == "slow":
            await asyncio.sleep(1)
        if mode["kind"] == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return web.json_response({"ok": True})

    a.behaviour = behave
    caplog.set_level(logging.DEBUG)
    router = await router_for(a, first_byte_timeout=0.2, failures_before_ejection=100, log_level="debug")
    body = {**CHAT, "messages": [{"role": "user", "content": f"secret {MARKER} text " * 20}]}
    try:
        async with aiohttp.ClientSession(headers=JSON_TYPE) as client:
            for kind in ("ok", "cut", "slow", "500", "ok"):
                mode["kind"] = kind
                async with client.post(router.url + "/v1/chat/completions", json=body) as r:
                    try:
                        await r.read()
                    except aiohttp.ClientPayloadError:
                        pass
            for bad in (b'{"messages": [{"role": "user", "content": "' + MARKER.encode() + b'"',
                        b'{"messages": [{"role": "user", "content": 5, "name": "' + MARKER.encode() + b'"}]}',
                        b'{"messages": "' + MARKER.encode() + b'"}'):
                async with client.post(router.url + "/v1/chat/completions", data=bad) as r:
                    assert r.status == 400
        raw = json.dumps(body).encode()
        await _raw(router.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 10\r\n\r\n" + raw)
        await asyncio.sleep(0.1)
    finally:
        await router.stop()
        await a.stop()
    assert caplog.records  # logging was on and did record things
    for rec in caplog.records:
        text = rec.getMessage() + (logging.Formatter().formatException(rec.exc_info) if rec.exc_info else "")
        assert MARKER not in text, (rec.name, text[:400])


def test_token_comparison_is_constant_time(monkeypatch):
    calls = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert auth.token_matches(TOKEN, TOKEN)
    for wrong in ("", "x", TOKEN[:-1], TOKEN + "x", TOKEN.upper(), "é" * 5, "\udcff"):
        assert not auth.token_matches(wrong, TOKEN)
    assert not auth.token_matches(None, TOKEN)
    assert len(calls) == 8  # every comparison of a given token went through compare_digest


async def test_admin_token_is_never_logged_or_echoed(caplog):
    caplog.set_level(logging.DEBUG)
    a = await Upstream("a").start()
    router = await router_for(a, admin_token=TOKEN, log_level="debug")
    try:
        async with aiohttp.ClientSession(headers=JSON_TYPE) as client:
            for token in (TOKEN, TOKEN + "-wrong"):
                for method, path in (("GET", "/admin/instances"), ("POST", "/admin/instances/a/drain")):
                    async with client.request(method, router.url + path,
                                              headers={"Authorization": f"Bearer {token}"}) as r:
                        assert TOKEN not in await r.text()
                        assert TOKEN not in json.dumps(dict(r.headers))
            async with client.get(router.url + "/metrics") as r:
                assert TOKEN not in await r.text()
    finally:
        await router.stop()
        await a.stop()
    assert all(TOKEN not in rec.getMessage() for rec in caplog.records)
