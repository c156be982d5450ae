"""Admission control end to end: the router's queue over real HTTP on loopback, in front of emulated engines.

Overload, a full queue, deadlines, clients that leave while queued and an instance killed while requests wait:
every request gets an answer (200, or 429/503 with a JSON body), none hangs, and the books return to zero (no
request in flight, no slot reserved, nothing queued, every queue gauge back to 0).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from client_helpers import wait_for
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import start_fleet
from warmroute.router.app import ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

KV_TOKENS = 200_000


def _chat(doc: int, question: int, max_tokens: int = 8) -> dict:
    system = f"Document {doc}. " + "".join(f"Clause {doc}.{i}: term {i * 7 + doc}. " for i in range(80))
    return {"model": "warmroute-emulated", "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {question}"}]}


@contextlib.asynccontextmanager
async def _stack(count: int = 2, time_scale: float = 1.0, **settings):
    """Emulated engines, a router in front and a client; once the test's body is done, the books must return to
    zero (no request in flight, no slot reserved, nothing queued). The router is told each engine runs
    concurrency_threshold requests at once (engine_capacity), unless the test says otherwise."""
    if "concurrency_threshold" in settings:
        settings.setdefault("engine_capacity", settings["concurrency_threshold"])
    fleet = await start_fleet(count, config=EngineConfig.from_profile("8b", kv_capacity_tokens=KV_TOKENS),
                              time_scale=time_scale)
    router = None
    try:
        router = await start_router(load_settings({
            "backends": [f"e{i}={u}" for i, u in enumerate(fleet.urls)], "port": 0, "kv_capacity_tokens": KV_TOKENS,
            "health_interval": 0.2, "engine_metrics": False, **settings}, env={}))
        async with aiohttp.ClientSession() as client:
            yield fleet, router, client
        await wait_for(lambda: _books_are_zero(router), timeout=10)
    finally:
        if router is not None:
            await router.stop()
        await fleet.close()


async def _post(client: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None):
    async with client.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.json()


def _books_are_zero(router) -> bool:
    r = router.app[ROUTER]
    queued = [s.value for m in r.metrics.queue_waiting.collect() for s in m.samples]
    return (r.admission.idle() and not r.admission.active_tenants
            and all(i.inflight == 0 and i.inflight_prompt_tokens == 0 for i in r.fleet.instances.values())
            and not any(queued))


def _metric(router, name: str, **labels) -> float:
    return router.app[ROUTER].metrics.registry.get_sample_value(name, labels) or 0.0


async def test_overload_waits_in_the_router_and_every_request_is_answered():
    """24 requests at once on 2 instances that take 2 each: the rest wait in the router (x-warmroute-reason
    says how long), all are answered, each at the instance holding its document, and the books return to zero."""
    async with _stack(concurrency_threshold=2) as (fleet, router, client):
        for doc in (0, 1):  # each document's first request places it
            assert (await _post(client, router.url, _chat(doc, 0)))[0] == 200
        answers = await asyncio.wait_for(asyncio.gather(
            *(_post(client, router.url, _chat(q % 2, q)) for q in range(24))), 60)
        assert all(status == 200 for status, _, _ in answers)
        queued = [h["x-warmroute-reason"] for _, h, _ in answers if "; queued=" in h["x-warmroute-reason"]]
        assert len(queued) >= 12 and all(r.endswith("s; engine_full") for r in queued)
        assert all(float(r.split("queued=")[1].split("s;")[0]) > 0 for r in queued)
        homes = {}
        for (_, h, _), q in zip(answers, range(24)):
            homes.setdefault(q % 2, set()).add(h["x-warmroute-instance"])
        assert all(len(v) == 1 for v in homes.values())  # affinity kept under overload: no spill
        assert _metric(router, "warmroute_admissions_total", how="engine_full") >= 12


async def test_a_full_queue_answers_429_with_retry_after_and_leaks_nothing():
    async with _stack(concurrency_threshold=1, queue_max_requests=2) as (fleet, router, client):
        answers = await asyncio.wait_for(asyncio.gather(
            *(_post(client, router.url, _chat(0, q)) for q in range(12))), 60)
        refused = [(h, body) for status, h, body in answers if status == 429]
        assert refused and all(h["Retry-After"].isdigit() and "queue is full" in b["error"]["message"]
                               for h, b in refused)
        assert all(status in (200, 429) for status, _, _ in answers)
        assert _metric(router, "warmroute_sheds_total", reason="queue_full", priority="0") == len(refused)


async def test_past_its_deadline_a_waiting_request_gets_429_not_a_hang():
    async with _stack(count=1, concurrency_threshold=1, queue_timeout=0.3) as (fleet, router, client):
        slow = asyncio.ensure_future(_post(client, router.url, _chat(0, 0, max_tokens=200)))
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        start = loop.time()
        status, headers, body = await asyncio.wait_for(_post(client, router.url, _chat(0, 1)), 10)
        assert status == 429 and "timeout_s" in body["error"]["message"] and "Retry-After" in headers
        assert loop.time() - start < 2.0
        assert (await slow)[0] == 200


async def test_clients_that_leave_while_queued_leave_the_queue_at_once():
    async with _stack(count=1, concurrency_threshold=1) as (fleet, router, client):
        slow = asyncio.ensure_future(_post(client, router.url, _chat(0, 0, max_tokens=300)))
        await asyncio.sleep(0.1)
        leavers = [asyncio.ensure_future(_post(client, router.url, _chat(0, q))) for q in range(1, 9)]
        await wait_for(lambda: len(router.app[ROUTER].admission.waiters) == 8)
        for t in leavers:
            t.cancel()
        await wait_for(lambda: not router.app[ROUTER].admission.waiters, timeout=2.0)
        assert _metric(router, "warmroute_sheds_total", reason="client_closed", priority="0") == 8
        assert not slow.done()  # they left long before the instance had room
        assert (await slow)[0] == 200


async def test_an_instance_killed_during_overload_leaves_no_request_hanging():
    """One of two instances dies while requests wait for it: those waiting for it go to the survivor (or fail
    cleanly), none hangs, and the books return to zero."""
    async with _stack(concurrency_threshold=2, hold_timeout=1.0) as (fleet, router, client):
        tasks = [asyncio.ensure_future(_post(client, router.url, _chat(q % 4, q, max_tokens=30)))
                 for q in range(20)]
        await wait_for(lambda: len(router.app[ROUTER].admission.waiters) >= 8)
        await fleet.servers[0].close()
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        statuses = [s for s, _, _ in answers]
        assert all(s in (200, 502, 503, 504) for s in statuses) and statuses.count(200) >= 10


async def test_priority_and_tenant_come_from_headers_and_a_bad_priority_is_a_400():
    async with _stack(count=1, concurrency_threshold=1, trust_client_headers=True, priority_classes="-5,0,5",
                      tenant_max_priorities="web=5") as (fleet, router, client):
        status, _, body = await _post(client, router.url, _chat(0, 0), {"x-priority": "high"})
        assert status == 400 and "x-priority" in body["error"]["message"]
        slow = asyncio.ensure_future(_post(client, router.url, _chat(0, 0, max_tokens=100)))
        await asyncio.sleep(0.1)
        low = asyncio.ensure_future(_post(client, router.url, _chat(0, 1), {"x-priority": "-5",
                                                                             "x-tenant": "batch"}))
        await wait_for(lambda: len(router.app[ROUTER].admission.waiters) == 1)
        high = asyncio.ensure_future(_post(client, router.url, _chat(0, 2), {"x-priority": "5",
                                                                              "x-tenant": "web"}))
        await wait_for(lambda: len(router.app[ROUTER].admission.waiters) == 2)
        assert _metric(router, "warmroute_queue_waiting", priority="-5", tenant="batch") == 1
        await slow
        done, _ = await asyncio.wait([low, high], return_when=asyncio.FIRST_COMPLETED)
        assert done == {high}  # the higher priority went first though it came later
        assert (await low)[0] == 200


async def test_a_tenant_past_its_queue_share_waits_in_the_router_while_another_is_served():
    """tenant_queue_share 0.5 on one instance taking 8 (engines at quarter speed): while tenant quiet has a
    request in flight, tenant noisy has at most 2 (0.5 x 8 / 2 tenants) awaiting their first token there; its
    other requests wait in the router though the instance has room (admissions how="share") and go as those
    get their first tokens; all are answered, and the books return to zero."""
    async with _stack(count=1, time_scale=4.0, concurrency_threshold=8, tenant_queue_share=0.5,
                      trust_client_headers=True) as (
            fleet, router, client):
        quiet = asyncio.ensure_future(_post(client, router.url, _chat(0, 0, max_tokens=100), {"x-tenant": "quiet"}))
        await wait_for(lambda: router.app[ROUTER].fleet.instances["e0"].inflight == 1)
        noisy = [asyncio.ensure_future(_post(client, router.url, _chat(q, q), {"x-tenant": "noisy"}))
                 for q in range(1, 7)]  # each its own document: a cold prompt, a long prefill
        await wait_for(lambda: len(router.app[ROUTER].admission.waiters) == 4)
        assert router.app[ROUTER].fleet.instances["e0"].inflight == 3  # quiet's and noisy's 2
        answers = await asyncio.wait_for(asyncio.gather(*noisy), 60)
        assert all(status == 200 for status, _, _ in answers)
        assert sum("; queued=" in h["x-warmroute-reason"] for _, h, _ in answers) == 4
        assert _metric(router, "warmroute_admissions_total", how="share") == 4
        assert (await quiet)[0] == 200


async def _stream(client: aiohttp.ClientSession, url: str, body: dict, headers: dict):
    """A streamed chat request (the first token arrives before the answer ends): status, headers, the whole text."""
    async with client.post(url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as r:
        return r.status, dict(r.headers), await r.text()


async def test_an_instance_at_its_prefill_budget_holds_requests_in_the_router_while_tenants_compete():
    """prefill_budget 1 token on one instance taking 8 (engines at quarter speed), tenant quiet weighing 7 and
    noisy 1 (a share of 1 slot): once quiet's streamed request is decoding (it keeps quiet active), noisy's burst
    of cold prompts goes one at a time, each when the one before has its first token; the rest wait in the router
    though the instance has room (admissions how="prefill"); all are answered, and the books return to zero."""
    async with _stack(count=1, time_scale=4.0, concurrency_threshold=8, prefill_budget=1,
                      tenant_weights={"quiet": 7.0}, trust_client_headers=True) as (fleet, router, client):
        r = router.app[ROUTER]
        quiet = asyncio.ensure_future(_stream(client, router.url, _chat(0, 0, max_tokens=300), {"x-tenant": "quiet"}))
        await wait_for(lambda: r.fleet.instances["e0"].inflight == 1 and r.fleet.instances["e0"].pending == 0)
        noisy = [asyncio.ensure_future(_stream(client, router.url, _chat(q, q), {"x-tenant": "noisy"}))
                 for q in range(1, 7)]  # each its own document: a cold prompt, a long prefill
        await wait_for(lambda: len(r.admission.waiters) == 5)
        assert r.fleet.instances["e0"].inflight == 2  # quiet's, and the one of noisy's prefilling
        answers = await asyncio.wait_for(asyncio.gather(*noisy), 60)
        assert all(status == 200 and "[DONE]" in text for status, _, text in answers)
        assert sum("; queued=" in h["x-warmroute-reason"] for _, h, _ in answers) == 5
        assert _metric(router, "warmroute_admissions_total", how="prefill") == 5
        assert (await quiet)[0] == 200


async def _peak_running(client: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> int:
    """The most requests the engine reported running (its /metrics) until `stop`."""
    peak = 0
    while not stop.is_set():
        async with client.get(url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("vllm:num_requests_running"):
                    peak = max(peak, int(float(line.split()[-1])))
        await asyncio.sleep(0.05)
    return peak


async def test_one_engine_with_a_large_batch_is_never_capped_by_the_router_at_its_defaults():
    """(d) #32: one engine that runs 256 at once behind a router at its default settings (threshold 32, admission
    on, engine metrics scraped), 64 concurrent requests: none waits in the router, and the engine runs them
    together, past the threshold."""
    fleet = await start_fleet(1, config=EngineConfig.from_profile("8b", kv_capacity_tokens=KV_TOKENS), time_scale=0.5)
    router = None
    try:
        router = await start_router(load_settings({"backends": [f"e0={fleet.urls[0]}"], "port": 0}, env={}))
        async with aiohttp.ClientSession() as client:
            stop = asyncio.Event()
            peak = asyncio.create_task(_peak_running(client, fleet.urls[0], stop))
            answers = await asyncio.wait_for(asyncio.gather(
                *(_post(client, router.url, _chat(q % 4, q, max_tokens=300)) for q in range(64))), 120)
            stop.set()
            assert all(status == 200 for status, _, _ in answers)
            assert not [h for _, h, _ in answers if "queued=" in h["x-warmroute-reason"]]
            assert _metric(router, "warmroute_admissions_total", how="immediate") == 64
            assert await peak > 32
        await wait_for(lambda: _books_are_zero(router), timeout=10)
    finally:
        if router is not None:
            await router.stop()
        await fleet.close()
