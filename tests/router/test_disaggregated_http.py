"""A split request over real HTTP on 127.0.0.1 (router/proxy.py's `_forward_split`): the bodies of both legs as
vLLM's connectors and SGLang expect them, the failures of either leg, a client that leaves, and the books and
metrics after. The stand-ins answer as a vLLM prefill instance with the NixlConnector does (its fields only);
the emulated engine's own P/D is tested in tests/engine and with the router in test_router_engine.py."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from fake_upstream import Upstream
from warmroute.router.app import ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

LONG = {"model": "m", "max_tokens": 20, "stream": False, "messages": [
    {"role": "system", "content": "You review contracts for the legal team, clause by clause. " * 40},
    {"role": "user", "content": "Summarise clause 4."}]}
SHORT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def prefill_answer(engine: str):
    """A prefill instance's answer: one token, and where its KV cache waits for the decode instance."""
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({
            "choices": [{"message": {"content": "x"}}],
            "usage": {"prompt_tokens": 500, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
                                   "remote_engine_id": engine, "remote_host": "127.0.0.1", "remote_port": 5600}})
    return answer


async def failing(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "engine error"}}, status=500)


def bodies(up: Upstream) -> list[dict]:
    return [json.loads(body) for _, path, _, body in up.seen if path == "/v1/chat/completions"]


class Fleet:
    def __init__(self, prefill: list[Upstream], decode: list[Upstream], router) -> None:
        self.prefill, self.decode, self.router = prefill, decode, router
        self.core = router.app[ROUTER]

    def metric(self, name: str, **labels: str) -> float:
        return self.core.metrics.registry.get_sample_value(name, labels) or 0.0

    def in_flight(self) -> int:
        return sum(i.inflight + i.pending for i in self.core.fleet.instances.values())


@pytest.fixture
async def pd():
    started: list[Upstream] = []
    routers = []

    async def make(prefill: int = 2, decode: int = 1, **overrides) -> Fleet:
        ps = [await Upstream(f"p{i}").start() for i in range(prefill)]
        ds = [await Upstream(f"d{i}").start() for i in range(decode)]
        started.extend(ps + ds)
        for i, p in enumerate(ps):
            p.behaviour = prefill_answer(f"engine-p{i}")
        values = {"backends": [f"prefill@{u.name}={u.url}" for u in ps] + [f"decode@{u.name}={u.url}" for u in ds],
                  "port": 0, "health_interval": 3600, "engine_metrics": False, "models_interval": 0,
                  "pd_threshold_tokens": 64, **overrides}
        router = await start_router(load_settings(values, env={}))
        routers.append(router)
        return Fleet(ps, ds, router)

    yield make
    for r in routers:
        await r.stop()
    for u in started:
        await u.stop()


async def post(router, body: dict) -> tuple[int, dict[str, str], dict]:
    async with aiohttp.ClientSession() as client:
        async with client.post(router.url + "/v1/chat/completions", json=body) as r:
            return r.status, dict(r.headers), await r.json()


async def test_a_long_prompt_is_prefilled_then_decoded_with_the_transfer_parameters(pd):
    f = await pd()
    status, headers, answer = await post(f.router, LONG)
    assert status == 200 and answer["upstream"] == "d0"
    (pre,) = [b for p in f.prefill for b in bodies(p)]
    assert (pre["max_tokens"], pre["stream"]) == (1, False) and pre["messages"] == LONG["messages"]
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                         "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                         "remote_port": None}
    (dec,) = bodies(f.decode[0])
    engine = headers["x-warmroute-prefill-instance"]
    assert dec == {**LONG, "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                                  "remote_block_ids": [1, 2], "remote_engine_id": f"engine-{engine}",
                                                  "remote_host": "127.0.0.1", "remote_port": 5600}}
    assert headers["x-warmroute-instance"] == "d0" and "pd=split" in headers["x-warmroute-reason"]
    assert f.metric("warmroute_pd_decisions_total", why="split") == 1
    assert f.metric("warmroute_pd_legs_total", pool="prefill", outcome="ok") == 1
    assert f.metric("warmroute_pd_legs_total", pool="decode", outcome="ok") == 1
    assert f.metric("warmroute_pd_transfer_tokens_total") > 0
    assert f.metric("warmroute_engine_prompt_tokens_total", backend=engine) == 500  # the prefill leg's usage
    assert f.in_flight() == 0


NEXT = {**LONG, "messages": [LONG["messages"][0], {"role": "user", "content": "And clause 5?"}]}


async def test_a_prompt_whose_prefix_its_decode_instance_received_goes_there_whole(pd):
    f = await pd(prefill=2)
    await post(f.router, LONG)
    _, headers, _ = await post(f.router, NEXT)  # the decode instance holds the contract now: nothing to move
    assert "pd=cached_at_decode" in headers["x-warmroute-reason"] and bodies(f.decode[0])[-1] == NEXT


async def test_with_no_threshold_a_prompt_is_prefilled_where_its_prefix_is(pd):
    f = await pd(prefill=4, pd_threshold_tokens=0)
    _, first, _ = await post(f.router, LONG)
    _, second, _ = await post(f.router, NEXT)
    assert first["x-warmroute-prefill-instance"] == second["x-warmroute-prefill-instance"]
    assert "pd=split" in second["x-warmroute-reason"]


async def test_a_short_prompt_goes_whole_to_the_decode_instance(pd):
    f = await pd()
    status, headers, _ = await post(f.router, SHORT)
    assert status == 200 and bodies(f.decode[0]) == [SHORT]
    assert not any(bodies(p) for p in f.prefill)
    assert "pd=short_prompt" in headers["x-warmroute-reason"] and "x-warmroute-prefill-instance" not in headers
    assert f.metric("warmroute_pd_decisions_total", why="short_prompt") == 1


async def test_a_failed_prefill_leg_is_tried_at_the_other_prefill_instance(pd):
    f = await pd()
    calls: list[str] = []

    def first_fails(name: str):
        async def answer(request: web.Request) -> web.Response:
            calls.append(name)
            return await (failing if len(calls) == 1 else prefill_answer(f"engine-{name}"))(request)
        return answer
    for p in f.prefill:
        p.behaviour = first_fails(p.name)
    status, headers, _ = await post(f.router, LONG)
    assert status == 200 and len(calls) == 2 and calls[0] != calls[1]
    assert headers["x-warmroute-prefill-instance"] == calls[1]
    assert bodies(f.decode[0])[-1]["kv_transfer_params"]["remote_engine_id"] == f"engine-{calls[1]}"
    assert f.metric("warmroute_pd_legs_total", pool="prefill", outcome="failed") == 1
    assert f.in_flight() == 0


async def test_when_both_prefill_instances_fail_the_request_goes_whole_to_its_decode_instance(pd):
    f = await pd()
    f.prefill[0].behaviour = f.prefill[1].behaviour = failing
    status, headers, _ = await post(f.router, LONG)
    assert status == 200 and bodies(f.decode[0]) == [LONG] and all(bodies(p) for p in f.prefill)
    assert f.metric("warmroute_pd_legs_total", pool="prefill", outcome="failed") == 2
    assert "x-warmroute-prefill-instance" not in headers and f.in_flight() == 0


async def test_a_decode_leg_that_cannot_connect_is_sent_whole_to_another_decode_instance(pd):
    f = await pd(prefill=1, decode=2, pd_threshold_tokens=0)
    status, headers, _ = await post(f.router, LONG)
    chosen = headers["x-warmroute-instance"]
    down = next(d for d in f.decode if d.name == chosen)
    other = next(d for d in f.decode if d.name != chosen)
    await down.stop()
    status, headers, answer = await post(f.router, {**LONG, "messages": [LONG["messages"][0],
                                                                          {"role": "user", "content": "Clause 9?"}]})
    assert status == 200 and answer["upstream"] == other.name
    assert "kv_transfer_params" not in bodies(other)[-1]  # whole: its prefill leg's KV is at no reachable place
    assert f.metric("warmroute_pd_legs_total", pool="decode", outcome="failed") == 1
    assert f.in_flight() == 0


async def test_a_client_that_leaves_during_the_decode_leg_closes_both_legs(pd):
    f = await pd(prefill=1)
    started = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        started.set()
        await asyncio.sleep(30)
        return web.json_response({})
    f.decode[0].behaviour = slow
    async with aiohttp.ClientSession() as client:
        sent = asyncio.ensure_future(client.post(f.router.url + "/v1/chat/completions", json=LONG))
        await asyncio.wait_for(started.wait(), 5)
        instances = f.core.fleet.instances
        assert (instances["p0"].inflight, instances["d0"].inflight) == (0, 1)  # the prefill leg closed already
        sent.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sent
        await asyncio.wait_for(f.decode[0].cancelled.wait(), 5)
    for _ in range(50):
        if f.in_flight() == 0:
            break
        await asyncio.sleep(0.02)
    assert f.in_flight() == 0


async def test_bootstrap_sends_both_legs_at_once_paired_by_a_room(pd):
    f = await pd(prefill=1, pd_transfer="bootstrap")
    f.prefill[0].behaviour = None  # an echo
    host, port = f.prefill[0].url.split("//")[1].split(":")
    status, headers, answer = await post(f.router, LONG)
    assert status == 200 and answer["upstream"] == "d0"
    (pre,), (dec,) = bodies(f.prefill[0]), bodies(f.decode[0])
    assert pre == dec and pre["bootstrap_host"] == host and pre["bootstrap_port"] == 8998
    assert isinstance(pre["bootstrap_room"], int) and pre["messages"] == LONG["messages"]
    for _ in range(50):
        if f.in_flight() == 0:
            break
        await asyncio.sleep(0.02)
    assert f.in_flight() == 0


async def test_storage_runs_the_same_legs_without_parameters(pd):
    f = await pd(prefill=1, pd_transfer="storage")
    status, _, _ = await post(f.router, LONG)
    (pre,), (dec,) = bodies(f.prefill[0]), bodies(f.decode[0])
    assert status == 200 and "kv_transfer_params" not in pre and pre["max_tokens"] == 1 and dec == LONG


async def test_the_dashboard_shows_roles_splits_legs_and_the_prefill_pools_hit_rate(pd):
    f = await pd(prefill=1)
    await post(f.router, LONG)
    await post(f.router, SHORT)
    async with aiohttp.ClientSession() as client:
        async with client.get(f.router.url + "/dashboard/state") as r:
            state = await r.json()
    assert {i["name"]: i["role"] for i in state["instances"]} == {"p0": "prefill", "d0": "decode"}
    pd_state = state["disaggregation"]
    assert pd_state["decisions"] == {"split": 1.0, "short_prompt": 1.0}
    assert pd_state["legs_by_pool"] == {"prefill": 1.0, "decode": 1.0} and pd_state["prefill_hit_rate"] == 0.0
    assert pd_state["transfer_tokens"] > 0
