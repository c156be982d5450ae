"""A request held in the router while another request at its instance computes the prefix they share
(shared_prefill_wait_s; core/prefills.py): over real HTTP on loopback, in front of an emulated engine, which like
vLLM reuses a block of KV cache only once it is computed."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from client_helpers import Answer, ask, wait_for
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import start_fleet
from warmroute.router.app import ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

KV_TOKENS = 200_000


def _chat(doc: int, question: int, stream: bool = True, max_tokens: int = 4) -> dict:
    system = f"Document {doc}. " + "".join(f"Clause {doc}.{i}: term {i * 7 + doc}. " for i in range(120))
    body = {"model": "warmroute-emulated", "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {question}"}]}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


@contextlib.asynccontextmanager
async def _stack(time_scale: float = 4.0, **settings):
    """One emulated engine at a quarter of its speed, the router in front with its defaults otherwise, a client;
    once the test's body is done, nothing may be left in flight or waiting."""
    fleet = await start_fleet(1, config=EngineConfig.from_profile("8b", kv_capacity_tokens=KV_TOKENS),
                              time_scale=time_scale)
    router = None
    try:
        router = await start_router(load_settings({
            "backends": [f"e0={fleet.urls[0]}"], "port": 0, "kv_capacity_tokens": KV_TOKENS, "health_interval": 0.2,
            "engine_metrics": False, **settings}, env={}))
        async with aiohttp.ClientSession() as client:
            yield router, client
        r = router.app[ROUTER]
        await wait_for(lambda: all(i.inflight == 0 for i in r.fleet.instances.values()) and not r._prefill_waits
                       and len(r.fleet.prefills) == 0, timeout=10)
    finally:
        if router is not None:
            await router.stop()
        await fleet.close()


async def _two_at_once(client, url: str, first: dict, second: dict) -> tuple[Answer, Answer]:
    """`first`, then `second` while the engine is still busy with another document's prefill: without a wait in
    the router both reach its next step, which computes the prefix for each (as vLLM's scheduler would)."""
    busy = asyncio.ensure_future(ask(client, url, _chat(9, 0)))
    await asyncio.sleep(0.05)
    leader = asyncio.ensure_future(ask(client, url, first))
    await asyncio.sleep(0.05)
    follower = asyncio.ensure_future(ask(client, url, second))
    answers = await asyncio.wait_for(asyncio.gather(leader, follower, busy), 30)
    return answers[0], answers[1]


def _held(router, outcome: str) -> float:
    return router.app[ROUTER].metrics.registry.get_sample_value(
        "warmroute_shared_prefill_wait_seconds_count", {"outcome": outcome}) or 0.0


async def test_a_request_sent_while_its_prefix_is_being_computed_waits_for_it_and_finds_it_cached():
    async with _stack() as (router, client):
        first, second = await _two_at_once(client, router.url, _chat(0, 1), _chat(0, 2))
        assert "held=" in second.reason and second.reason.endswith("; shared_prefill")
        assert "held=" not in first.reason and first.cached_tokens == 0
        assert second.cached_tokens >= 0.9 * second.prompt_tokens  # the whole document, computed once
        assert _held(router, "computed") == 1


async def test_without_the_wait_both_compute_the_prefix():
    """The same two requests with shared_prefill_wait_s 0: the engine computes the document twice (what the wait
    saves)."""
    async with _stack(shared_prefill_wait_s=0) as (router, client):
        first, second = await _two_at_once(client, router.url, _chat(0, 1), _chat(0, 2))
        assert second.cached_tokens == 0 and "held=" not in second.reason
        assert _held(router, "computed") == 0


async def test_only_a_streamed_request_is_waited_for():
    """Without streaming the engine's first byte comes with its last: nothing marks the end of its prefill."""
    async with _stack() as (router, client):
        _, second = await _two_at_once(client, router.url, _chat(0, 1, stream=False), _chat(0, 2))
        assert "held=" not in second.reason and _held(router, "computed") == 0


async def test_the_wait_ends_at_shared_prefill_wait_s():
    async with _stack(shared_prefill_wait_s=0.02) as (router, client):
        _, second = await _two_at_once(client, router.url, _chat(0, 1), _chat(0, 2))
        held = float(second.reason.split("held=")[1].split("s;")[0])
        assert 0.02 <= held < 0.5 and _held(router, "timeout") == 1 and _held(router, "computed") == 0


async def test_a_client_that_leaves_while_held_leaves_nothing_behind():
    async with _stack() as (router, client):
        busy = asyncio.ensure_future(ask(client, router.url, _chat(9, 0)))  # the leader waits its turn behind it
        await asyncio.sleep(0.05)
        leader = asyncio.ensure_future(ask(client, router.url, _chat(0, 1)))
        await asyncio.sleep(0.05)
        follower = asyncio.ensure_future(ask(client, router.url, _chat(0, 2)))
        r = router.app[ROUTER]
        await wait_for(lambda: bool(r._prefill_waits))
        assert r.fleet.instances["e0"].inflight == 3  # the held request counts at its instance
        follower.cancel()
        await wait_for(lambda: r.fleet.instances["e0"].inflight == 2)
        assert (await leader).cached_tokens == 0 and (await busy).cached_tokens == 0
