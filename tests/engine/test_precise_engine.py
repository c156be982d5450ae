"""Precise mode end to end: the router in front of emulated engines that publish their KV-cache events (vLLM's
ZMQ format, with replay), and what happens when an engine is killed and restarted, loses part of its stream, or
puts garbage on its socket: the router keeps routing, says so in its metrics, and gets back in step."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from client_helpers import ask, wait_for
from warmroute.bench.processes import free_ports
from warmroute.engine.kv_events import KvEventPublisher
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import EngineServer, start_fleet
from warmroute.engine.tokenizer import default_tokenizer_dir, load_tokenizer
from warmroute.router.app import ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

KV_TOKENS = 20_000
TIME_SCALE = 0.02
CONFIG = EngineConfig.from_profile("8b", kv_capacity_tokens=KV_TOKENS)


def chat(doc: int, question: int) -> dict:
    system = f"Document {doc}. " + "".join(f"Clause {doc}.{i}: the parties agree to term {i * 7 + doc}. "
                                           for i in range(60))
    return {"model": "warmroute-emulated", "max_tokens": 2,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Question {question}: what does clause {question} say?"}]}


def backend(server: EngineServer) -> dict:
    pub = server.kv_events
    entry = {"name": server.name, "url": server.url, "kv_events_endpoint": pub.endpoint}
    if pub.replay_endpoint:
        entry["kv_events_replay_endpoint"] = pub.replay_endpoint
    return entry


async def router_for(engines, backends: list[dict] | None = None) -> object:
    """A precise-mode router; `backends` (default: each engine with its event endpoints) as the entries."""
    return await start_router(load_settings({
        "backends": backends or [backend(s) for s in engines.servers], "port": 0, "kv_events": True,
        "tokenizer": str(default_tokenizer_dir()), "kv_capacity_tokens": KV_TOKENS, "health_interval": 0.2,
        "engine_metrics": False, "models_interval": 0}, env={}))


async def metrics_text(client, router) -> str:
    async with client.get(router.url + "/metrics") as r:
        return await r.text()


def sample(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
async def engines():
    fleet = await start_fleet(2, config=CONFIG, time_scale=TIME_SCALE, kv_events_port=0)
    yield fleet
    await fleet.close()


async def test_precise_predictions_match_what_the_engines_report(engines):
    router = await router_for(engines)
    exact = router.app[ROUTER].exact
    try:
        async with aiohttp.ClientSession() as client:
            homes = {}
            for doc in range(3):
                homes[doc], reason, cached, _ = await ask(client, router.url, chat(doc, 0))
                assert reason == "cold; match=precise" and cached == 0
            await wait_for(lambda: sum(exact.size(s.name) for s in engines.servers) > 0)
            for question in range(1, 3):
                for doc in range(3):
                    async with client.post(router.url + "/v1/chat/completions", json=chat(doc, question)) as r:
                        body = await r.json()
                        assert r.status == 200, body
                        assert r.headers["x-warmroute-instance"] == homes[doc]
                        assert r.headers["x-warmroute-reason"] == "cache_hit; match=precise"
                        predicted = float(r.headers["x-warmroute-predicted-hit"]) * body["usage"]["prompt_tokens"]
                    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                    assert abs(predicted - cached) <= 1, (predicted, cached)  # the header's 4 decimals
            text = await metrics_text(client, router)
            for s in engines.servers:
                assert sample(text, "warmroute_kv_events_stale", backend=s.name) == 0
            assert sum(sample(text, "warmroute_kv_events_applied_total", backend=s.name)
                       for s in engines.servers) > 0
    finally:
        await router.stop()


async def restart(engines, i: int) -> EngineServer:
    """Kill instance i and start a new process of it on the same ports (its cache empty, its sequence from 0)."""
    old = engines.servers[i]
    port = int(old.url.rsplit(":", 1)[1])
    endpoint, replay = old.kv_events.endpoint, old.kv_events.replay_endpoint
    await old.close()
    new = EngineServer(CONFIG, load_tokenizer(), name=old.name, time_scale=TIME_SCALE,
                       kv_events=KvEventPublisher(endpoint, replay_endpoint=replay, bind=True))
    await new.start("127.0.0.1", port)
    engines.servers[i] = new
    return new


async def test_killed_and_restarted_engine(engines):
    router = await router_for(engines)
    exact = router.app[ROUTER].exact
    victim = engines.servers[0]
    try:
        async with aiohttp.ClientSession() as client:
            doc = 0
            while (await ask(client, router.url, chat(doc, 0))).instance != victim.name:  # one of its documents
                doc += 1
            await wait_for(lambda: exact.size(victim.name) > 0)
            await victim.close()  # killed: its cache is gone
            for q in range(1, 4):  # the router keeps routing, to the other instance
                answer = await ask(client, router.url, chat(doc, q))
                assert answer.instance == engines.servers[1].name
            await restart(engines, 0)
            # The new process published nothing: the router finds it out (replay) and forgets the old blocks.
            await wait_for(lambda: exact.size(victim.name) == 0, timeout=15)
            text = await metrics_text(client, router)
            assert sample(text, "warmroute_kv_events_gaps_total", backend=victim.name, kind="restart") >= 1
            await wait_for(lambda: router.app[ROUTER].fleet.instances[victim.name].healthy, timeout=10)
            # The index is cleared before the replay that finds the new process empty: in step once it answers.
            await wait_for(lambda: victim.name in exact.fresh, timeout=10)
    finally:
        await router.stop()


async def test_dropped_batches_and_garbage(engines):
    router = await router_for(engines)
    exact = router.app[ROUTER].exact
    server = engines.servers[1]
    pub = server.kv_events
    try:
        async with aiohttp.ClientSession() as client:
            for doc in range(4):
                await ask(client, router.url, chat(doc, 0))
            await wait_for(lambda: len(pub.buffer) > 0 and exact.size(server.name) > 0)
            # a batch lost on the way, still in the replay buffer: asked for, the instance stays in step
            pub.buffer.append((pub.seq, pub.buffer[-1][1]))
            pub.seq += 1
            for doc in range(4, 10):
                await ask(client, router.url, chat(doc, 0))
            await wait_for(lambda: gaps(router, server.name) >= 1)
            assert server.name in exact.fresh
            # garbage under a sequence number: its events are lost for good, so the model decides for it
            pub.publish_raw(b"\xc1 not msgpack")
            for doc in range(10, 16):
                await ask(client, router.url, chat(doc, 0))
            await wait_for(lambda: server.name not in exact.fresh)
            reasons = {(await ask(client, router.url, chat(doc, 1)))[:2] for doc in range(10, 16)}
            assert (server.name, "cache_hit; match=approximate") in reasons  # still routed, by the model
            text = await metrics_text(client, router)
            assert sample(text, "warmroute_kv_events_bad_total", backend=server.name) >= 1
            assert sample(text, "warmroute_kv_events_stale", backend=server.name) == 1
            await restart(engines, 1)  # in step again with the new process
            await wait_for(lambda: server.name in exact.fresh and exact.size(server.name) == 0, timeout=15)
    finally:
        await router.stop()


def gaps(router, name: str) -> float:
    return router.app[ROUTER].metrics.registry.get_sample_value(
        "warmroute_kv_events_gaps_total", {"backend": name, "kind": "gap"}) or 0.0


async def test_a_lost_batch_without_replay_leaves_the_model_to_decide():
    engines = await start_fleet(2, config=CONFIG, time_scale=TIME_SCALE, kv_events_port=0, kv_events_replay=False)
    router = await router_for(engines)
    exact = router.app[ROUTER].exact
    # Without replay nothing tells a subscriber what was published before its socket connected (it connects
    # in the background): it would be stale from the first batch on. Let it connect first.
    await asyncio.sleep(0.5)
    try:
        async with aiohttp.ClientSession() as client:
            home = (await ask(client, router.url, chat(0, 0))).instance
            await wait_for(lambda: home in exact.fresh and exact.size(home) > 0)
            server = next(s for s in engines.servers if s.name == home)
            server.kv_events.seq += 1  # a batch lost, and no replay socket to ask
            for doc in range(1, 8):
                await ask(client, router.url, chat(doc, 0))
            await wait_for(lambda: home not in exact.fresh)
            answer = await ask(client, router.url, chat(0, 1))  # still routed, by the model, to its home
            assert answer == (home, "cache_hit; match=approximate", answer.cached_tokens, answer.prompt_tokens)
            assert answer.cached_tokens > 0
            text = await metrics_text(client, router)
            assert sample(text, "warmroute_kv_events_stale", backend=home) == 1
    finally:
        await router.stop()
        await engines.close()


async def test_the_router_asks_each_engine_where_it_publishes(engines):
    """No endpoints configured: the router asks each engine (GET /kv_event_sources, answered as vLLM does) where
    it publishes, follows it, and decides exactly."""
    router = await router_for(engines, [{"name": s.name, "url": s.url} for s in engines.servers])
    exact = router.app[ROUTER].exact
    try:
        await wait_for(lambda: exact.fresh == {s.name for s in engines.servers}, timeout=10)
        async with aiohttp.ClientSession() as client:
            first = await ask(client, router.url, chat(0, 0))
            await wait_for(lambda: exact.size(first.instance) > 0)
            again = await ask(client, router.url, chat(0, 1))
        assert (again.instance, again.reason) == (first.instance, "cache_hit; match=precise")
        assert again.cached_tokens > 0
    finally:
        await router.stop()


async def test_an_engine_started_after_the_router_is_found_once_it_answers():
    port = free_ports(1)
    router = await router_for(None, [{"name": "late", "url": f"http://127.0.0.1:{port}"}])
    exact = router.app[ROUTER].exact
    try:
        await asyncio.sleep(0.5)
        assert "late" not in exact.fresh  # nobody to ask yet: the approximate model would route for it
        fleet = await start_fleet(1, port, name="late", config=CONFIG, time_scale=TIME_SCALE, kv_events_port=0)
        try:
            await wait_for(lambda: "late" in exact.fresh, timeout=15)
        finally:
            await fleet.close()
    finally:
        await router.stop()
