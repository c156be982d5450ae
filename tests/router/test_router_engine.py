"""Routing behaviour end to end: the router in front of emulated engines (warmroute.engine).

Repeated prefixes must land on the instance that holds them and come back with cached_tokens > 0.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from client_helpers import ask
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import start_fleet
from warmroute.router.app import ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

KV_TOKENS = 200_000
TIME_SCALE = 0.02  # the engines run 50x faster than modelled


@pytest.fixture
async def engines():
    fleet = await start_fleet(3, config=EngineConfig.from_profile("8b", kv_capacity_tokens=KV_TOKENS),
                              time_scale=TIME_SCALE)
    yield fleet
    await fleet.close()


async def _router(engines, strategy: str = "cache_aware"):
    return await start_router(load_settings({
        "backends": [f"e{i}={u}" for i, u in enumerate(engines.urls)], "port": 0, "strategy": strategy,
        "kv_capacity_tokens": KV_TOKENS, "health_interval": 3600}, env={}))


def _chat(doc: int, question: int, stream: bool = False) -> dict:
    system = f"Document {doc}. " + "".join(f"Clause {doc}.{i}: the parties agree to term {i * 7 + doc}. "
                                           for i in range(120))
    return {"model": "warmroute-emulated", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Question {question}: what does clause {question} say?"}]}


async def test_cache_aware_sends_repeated_prefixes_to_the_instance_that_holds_them(engines):
    router = await _router(engines)
    try:
        async with aiohttp.ClientSession() as client:
            homes: dict[int, str] = {}
            for doc in range(4):  # first sight of each document: cold
                homes[doc], reason, cached, _ = await ask(client, router.url, _chat(doc, 0))
                assert reason == "cold" and cached == 0
            for question in range(1, 4):  # again, with new questions, one stream among them
                for doc in range(4):
                    instance, reason, cached, prompt = await ask(client, router.url,
                                                                  _chat(doc, question, stream=question == 2))
                    assert instance == homes[doc] and reason == "cache_hit"
                    assert cached > 0.8 * prompt  # the long document was cached; only the question is new
            assert len(set(homes.values())) > 1  # cold prefixes spread over the fleet
        fleet = router.app[ROUTER].fleet
        assert all(i.inflight == 0 and i.queued_prefill_tokens == 0 for i in fleet.instances.values())
    finally:
        await router.stop()


async def test_concurrent_load_on_one_prefix_spills_but_stays_cached(engines):
    router = await _router(engines)
    try:
        async with aiohttp.ClientSession() as client:
            first, *_ = await ask(client, router.url, _chat(9, 0))
            results = await asyncio.gather(*(ask(client, router.url, _chat(9, q)) for q in range(1, 25)))
        instances = [r[0] for r in results]
        assert instances.count(first) >= len(results) // 3  # the holder keeps most of its prefix's traffic
        # a prefix on every request is hot: once its holder had its share, copies go elsewhere, and say so
        assert "hot_spread" in {r[1] for r in results} and len(set(instances)) > 1
        hits = sum(1 for r in results if r[2] > 0)
        assert hits >= len(results) // 2
    finally:
        await router.stop()


async def test_random_routing_misses_more_than_cache_aware(engines):
    async def hit_tokens(strategy: str, salt: str) -> int:
        router = await _router(engines, strategy)
        total = 0
        try:
            async with aiohttp.ClientSession() as client:
                for question in range(4):
                    for doc in range(3):
                        body = _chat(doc, question)
                        body["cache_salt"] = salt  # a fresh cache namespace per strategy
                        total += (await ask(client, router.url, body))[2]
        finally:
            await router.stop()
        return total

    assert await hit_tokens("cache_aware", "ca") > await hit_tokens("random", "rnd")


@pytest.mark.parametrize("hold_kv_limit", [1.4, 1000.0])
async def test_a_conversation_waits_in_the_router_while_its_instance_is_full(hold_kv_limit, caplog):
    """Three turns of one conversation at once, with the router told each instance's KV cache holds two such
    prompts: the third would take its instance past hold_kv_limit (1.4) x its cache, so it waits in the router
    and goes to the same instance once one of the first two has finished; all three hit the cache, and the access
    log says how long the third waited. With the limit at 1000 nothing waits."""
    import json
    import logging

    from warmroute.core.routing_key import key_for_json
    from warmroute.router.access_log import LOGGER

    access = logging.getLogger(LOGGER)  # it does not propagate: listen on it
    access.addHandler(caplog.handler)

    prompt = key_for_json("/v1/chat/completions", _chat(9, 1)).tokens
    fleet = await start_fleet(2, config=EngineConfig.from_profile("8b", kv_capacity_tokens=KV_TOKENS),
                              time_scale=0.5)  # ~0.2 s a request: the three overlap
    router = await start_router(load_settings({
        "backends": [f"e{i}={u}" for i, u in enumerate(fleet.urls)], "port": 0, "kv_capacity_tokens": 2 * prompt,
        "hold_kv_limit": hold_kv_limit, "engine_metrics": False, "health_interval": 3600, "access_log": True},
        env={}))
    try:
        async with aiohttp.ClientSession() as client:
            home, *_ = await ask(client, router.url, _chat(9, 0))
            answers = await asyncio.gather(*(ask(client, router.url, _chat(9, q)) for q in (1, 2, 3)))
        assert all(a.instance == home and a.reason.startswith("cache_hit") and a.cached_tokens > 0.8 * a.prompt_tokens
                   for a in answers)
        metrics = router.app[ROUTER].metrics.registry
        held = metrics.get_sample_value("warmroute_admissions_total", {"how": "kv"}) or 0.0
        assert held == (1.0 if hold_kv_limit == 1.4 else 0.0)
        assert sum("; queued=" in a.reason for a in answers) == held  # x-warmroute-reason says it waited
        waiting = metrics.get_sample_value("warmroute_queue_waiting", {"priority": "0", "tenant": "anonymous"})
        assert waiting in (None, 0.0)
        books = router.app[ROUTER].fleet.instances[home]
        assert books.inflight == 0 and books.inflight_prompt_tokens == 0 and router.app[ROUTER].admission.idle()
        logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER]
        waited = [x for x in logged if "queued_ms" in x]
        assert len(logged) == 4 and len(waited) == held and all(0 < x["queued_ms"] < x["ms"] for x in waited)
    finally:
        access.removeHandler(caplog.handler)
        await router.stop()
        await fleet.close()
