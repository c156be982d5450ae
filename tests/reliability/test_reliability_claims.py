"""Who may claim what (issue #34), against a real `warmroute serve` process in front of a recording stand-in: a client
cannot raise its own priority or choose its tenant, rotating tenant names buys no extra share, what clients send
cannot grow /metrics without bound, keyless paths (/tokenize) wait for room like chats, and /metrics and the
dashboard can be put behind a token. docs/reliability.md lists the attacks and outcomes (run with -s for figures).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from fake_upstream import Upstream
from warmroute.bench.processes import Child
from warmroute.router.metrics import MAX_TENANT_LABELS

OBSERVER = "obs-token-5d1e"


def chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, engine: Upstream, *flags: str) -> AsyncIterator[str]:
    """A router process in front of `engine`, killed on exit; yields its URL."""
    router = Child("router", ["serve", "--backend", f"engine={engine.url}", "--port", "0", "--models-interval", "0",
                              "--no-engine-metrics", "--health-interval", "3600", *flags],
                   tmp_path)
    try:
        url = await router.wait_for_url(timeout_s=30)
        await router.wait_for_http(url + "/health", timeout_s=10)
        yield url
    finally:
        router.stop(grace_s=0)


def gated(engine: Upstream) -> asyncio.Event:
    """The engine holds every request until the returned event is set."""
    gate = asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        await gate.wait()
        return web.json_response({"ok": True})
    engine.behaviour = held
    return gate


async def waiting(client: aiohttp.ClientSession, router: str, n: int, headers: dict | None = None) -> None:
    """Until `n` requests wait in the router's queue (its dashboard's count)."""
    deadline = time.monotonic() + 20
    while True:
        async with client.get(router + "/dashboard/state", headers=headers) as r:
            if (await r.json())["queue"]["waiting"] == n:
                return
        assert time.monotonic() < deadline, f"never {n} waiting"
        await asyncio.sleep(0.02)


async def until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never met"
        await asyncio.sleep(0.02)


def contents(engine: Upstream) -> list[str]:
    """What each request the engine got asked, in arrival order (chat content or the tokenize prompt)."""
    out = []
    for _, _, _, body in engine.seen:
        doc = json.loads(body)
        out.append(doc["messages"][0]["content"] if "messages" in doc else doc.get("prompt", ""))
    return out


async def post(client: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with client.post(url, json=body, headers=headers) as r:
        return r.status, dict(r.headers)


async def test_a_client_cannot_raise_its_own_priority(tmp_path):
    """x-priority 1000 from an ordinary client neither jumps the queue nor, when it is full, gets a waiting request
    refused in its place (before: it went first, and the newest waiting request got 429 `preempted`)."""
    engine = await Upstream("engine").start()
    gate = gated(engine)
    try:
        async with serve(tmp_path, engine, "--engine-capacity", "1", "--queue-max-requests", "3") as router, \
                aiohttp.ClientSession() as client:
            url = router + "/v1/chat/completions"
            first = asyncio.ensure_future(post(client, url, chat("first")))
            await until(lambda: len(engine.seen) == 1)
            queued = []
            for n, text in enumerate(("b", "c")):
                queued.append(asyncio.ensure_future(post(client, url, chat(text))))
                await waiting(client, router, n + 1)
            spoofed = asyncio.ensure_future(post(client, url, chat("vip"), {"x-priority": "1000"}))
            await waiting(client, router, 3)
            status, headers = await post(client, url, chat("vip2"), {"x-priority": "1000", "x-tenant": "ops"})
            assert status == 429 and "Retry-After" in headers  # the queue is full: nobody is refused for it
            gate.set()
            results = await asyncio.wait_for(asyncio.gather(first, *queued, spoofed), 20)
            assert [s for s, _ in results] == [200, 200, 200, 200]
            assert contents(engine) == ["first", "b", "c", "vip"]  # in arrival order
            print("\n  x-priority 1000: served in arrival order (4th); a full queue refuses it (429), nobody else")
    finally:
        await engine.stop()


async def test_twenty_rotating_tenant_names_buy_no_extra_share(tmp_path):
    """An API-key holder sends 40 requests under 20 x-tenant names (one of them a tenant with weight 100), another
    sends 10 under its own key: the queue shares between the two keys, not 21 tenants (before: the honest tenant got
    1 of the first 20 slots)."""
    engine = await Upstream("engine").start()
    gate = gated(engine)
    try:
        async with serve(tmp_path, engine, "--engine-capacity", "1", "--tenant-weights", "vip=100") as router, \
                aiohttp.ClientSession() as client:
            url = router + "/v1/chat/completions"
            first = asyncio.ensure_future(post(client, url, chat("first")))
            await until(lambda: len(engine.seen) == 1)
            tasks = []
            for i in range(40):
                name = "vip" if i % 20 == 0 else f"team-{i % 20}"
                tasks.append(asyncio.ensure_future(post(client, url, chat(f"mallory {i}"),
                                                        {**bearer("sk-mallory"), "x-tenant": name})))
            await waiting(client, router, 40)
            tasks += [asyncio.ensure_future(post(client, url, chat(f"honest {i}"), bearer("sk-honest")))
                      for i in range(10)]
            await waiting(client, router, 50)
            gate.set()
            assert all(s == 200 for s, _ in await asyncio.wait_for(asyncio.gather(first, *tasks), 30))
            served = contents(engine)[1:21]
            honest = sum(c.startswith("honest") for c in served)
            print(f"\n  20 rotating tenant names: the honest key got {honest} of the next 20 slots (fair: 10)")
            assert honest >= 8
    finally:
        await engine.stop()


def series(text: str, name: str) -> list[str]:
    return re.findall(rf"^{name}\{{[^}}]*\}}", text, re.MULTILINE)


async def _spray(client: aiohttp.ClientSession, url: str, n: int, headers_of) -> list[int]:
    """n requests at 32 at a time, each with its own headers; their statuses."""
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> int:
        async with sem:
            return (await post(client, url, chat(f"spray {i}"), headers_of(i)))[0]
    return await asyncio.gather(*(one(i) for i in range(n)))


async def test_what_clients_send_cannot_grow_metrics_without_bound(tmp_path):
    """2,000 requests each with its own x-priority and x-tenant, then 2,000 each with its own API key, all refused by
    a full queue (each leaves a sample in the queue metrics): the series stay bounded by the priority classes and
    MAX_TENANT_LABELS tenants (before: one series per client-chosen pair, never removed). benchmarks/metrics_labels.py
    measures the scrape time and memory for 10,000."""
    engine = await Upstream("engine").start()
    gate = gated(engine)
    try:
        async with serve(tmp_path, engine, "--engine-capacity", "1", "--queue-max-requests", "1") as router, \
                aiohttp.ClientSession() as client:
            url = router + "/v1/chat/completions"
            first = asyncio.ensure_future(post(client, url, chat("first")))
            await until(lambda: len(engine.seen) == 1)
            held = asyncio.ensure_future(post(client, url, chat("held")))
            await waiting(client, router, 1)
            claimed = await _spray(client, url, 2000, lambda i: {"x-priority": str(i % 2001 - 1000),
                                                                 "x-tenant": f"t{i}"})
            keyed = await _spray(client, url, 2000, lambda i: bearer(f"sk-{i}"))
            assert set(claimed) == set(keyed) == {429}
            async with client.get(router + "/metrics") as r:
                text = await r.text()
            gate.set()
            await asyncio.gather(first, held)
        wait_series = series(text, "warmroute_queue_wait_seconds_count")
        shed_series = series(text, "warmroute_sheds_total")
        print(f"\n  4,000 claimed priorities/tenants and keys: {len(wait_series)} queue-wait series, "
              f"{len(shed_series)} shed series, /metrics {len(text) / 1024:.0f} KiB")
        assert len(wait_series) <= 2 * (MAX_TENANT_LABELS + 2)  # one class; anonymous; admitted and shed
        assert len(shed_series) <= 2 and len(text) < 256 * 1024
        assert 'priority="1000"' not in text and 'tenant="t1999"' not in text
    finally:
        await engine.stop()


async def test_tokenize_floods_wait_for_room_like_chats(tmp_path):
    """One key sends 20 /tokenize requests, another 4 chats, at an engine running 2 at once (engine_capacity; 0.2 s
    each): the engine never has more than 2 in flight (before: every /tokenize was forwarded at once), and the chats get their fair
    share of the slots instead of waiting behind the flood."""
    engine = await Upstream("engine").start()
    inflight = {"now": 0, "most": 0}

    async def slow(request: web.Request) -> web.Response:
        inflight["now"] += 1
        inflight["most"] = max(inflight["most"], inflight["now"])
        try:
            await asyncio.sleep(0.2)
            return web.json_response({"tokens": [1, 2, 3]})
        finally:
            inflight["now"] -= 1
    engine.behaviour = slow
    try:
        async with serve(tmp_path, engine, "--engine-capacity", "2") as router, \
                aiohttp.ClientSession() as client:
            flood = [asyncio.ensure_future(post(client, router + "/tokenize", {"model": "m", "prompt": f"flood {i}"},
                                                bearer("sk-flood"))) for i in range(20)]
            await waiting(client, router, 18)
            chats = [asyncio.ensure_future(post(client, router + "/v1/chat/completions", chat(f"chat {i}"),
                                                bearer("sk-chat"))) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*flood, *chats), 30)
            assert all(t.result()[0] == 200 for t in flood + chats)
            order = contents(engine)
            last_chat = max(i for i, c in enumerate(order) if c.startswith("chat"))
            print(f"\n  /tokenize flood: at most {inflight['most']} in flight at the engine (engine_capacity 2); "
                  f"the 4th chat was request {last_chat + 1} of 24")
            assert inflight["most"] <= 2
            assert last_chat < 12  # about every other slot, not after the flood
    finally:
        await engine.stop()


async def test_metrics_and_dashboard_need_the_observability_token_and_key_names_are_salted(tmp_path):
    """With observability_token, /metrics, /dashboard and /dashboard/state answer 401 without it (before: anyone
    read tenant names there); the tenant named after an API key is a salted hash, not the key's plain SHA-256."""
    engine = await Upstream("engine").start()
    gate = gated(engine)
    try:
        async with serve(tmp_path, engine, "--observability-token", OBSERVER, "--engine-capacity", "1") as router, \
                aiohttp.ClientSession() as client:
            url = router + "/v1/chat/completions"
            first = asyncio.ensure_future(post(client, url, chat("first")))
            await until(lambda: len(engine.seen) == 1)
            keyed = asyncio.ensure_future(post(client, url, chat("keyed"), bearer("sk-secret-key")))
            await waiting(client, router, 1, bearer(OBSERVER))
            basic = "Basic " + base64.b64encode(f"anyone:{OBSERVER}".encode()).decode()
            seen = []
            for path in ("/metrics", "/dashboard", "/dashboard/state"):
                for headers, want in (({}, 401), (bearer("wrong"), 401), (bearer(OBSERVER), 200),
                                      ({"Authorization": basic}, 200)):
                    async with client.get(router + path, headers=headers) as r:
                        body = await r.text()
                        assert r.status == want, (path, headers, r.status)
                        if want == 401:
                            assert "WWW-Authenticate" in r.headers and "observability token" in body
                        else:
                            seen.append(body)
            for path in ("/livez", "/health"):
                async with client.get(router + path) as r:
                    assert r.status == 200  # probes need no token
            gate.set()
            assert [s for s, _ in await asyncio.gather(first, keyed)] == [200, 200]
        unsalted = hashlib.sha256(b"sk-secret-key").hexdigest()[:12]
        assert any('tenant="key-' in text for text in seen)  # the waiting request's tenant is labelled...
        assert not any(unsalted in text or "sk-secret-key" in text for text in seen)  # ...by a salted hash
        print("\n  /metrics, /dashboard, /dashboard/state: 401 without the token, 200 with it (bearer or basic); "
              "key tenants salted")
    finally:
        await engine.stop()
