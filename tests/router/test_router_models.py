"""Fleets of mixed models behind one router: a request naming a model goes only to instances that serve it,
learnt from their /v1/models (or configured per backend), and a model nobody lists still goes anywhere."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from fake_upstream import CHAT, Upstream, router_for
from warmroute.core.fleet import Fleet
from warmroute.core.routing_key import key_for_json
from warmroute.core.strategies import STRATEGIES, ModelNotServed, make_strategy
from warmroute.router.app import CATALOG, HEALTH, ROUTER, UPSTREAMS


def fleet_of(models: dict[str, set[str] | None]) -> Fleet:
    fleet = Fleet()
    for name, served in models.items():
        fleet.add(name)
        fleet.set_models(name, frozenset(served) if served is not None else None)
    return fleet


def names(instances) -> list[str]:
    return sorted(i.name for i in instances)


def test_routable_instances_are_those_that_may_serve_the_model():
    fleet = fleet_of({"a": {"m1"}, "b": {"m2", "lora-x"}, "c": None})
    assert names(fleet.routable("m1")) == ["a", "c"]  # c's list is unknown: it may
    assert names(fleet.routable("lora-x")) == ["b", "c"]
    assert names(fleet.routable("nobody-lists-this")) == ["a", "b", "c"]  # no restriction for it
    assert names(fleet.routable(None)) == ["a", "b", "c"]
    fleet.set_models("c", frozenset({"m1"}))  # the cache of who serves what follows the lists
    assert names(fleet.routable("m2")) == ["b"]
    fleet.instances["b"].healthy = False
    assert fleet.routable("m2") == [] and names(fleet.routable("m1")) == ["a", "c"]


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_keeps_to_the_instances_that_serve_the_model(strategy):
    fleet = fleet_of({f"gpu-{i}": {"big" if i < 2 else "small"} for i in range(6)})
    s = make_strategy(strategy, seed=1)
    for i in range(60):
        key = key_for_json("/v1/completions", {"model": "small", "prompt": f"prompt {i} " * 50}, f"user-{i}")
        d = s.choose(key, fleet)
        assert d.instance in ("gpu-2", "gpu-3", "gpu-4", "gpu-5"), (strategy, d)
        fleet.dispatched(d.instance, d.uncached_tokens, list(d.blocks) if s.records_prefixes else None)


def test_cache_aware_does_not_follow_a_prefix_to_an_instance_without_the_model():
    fleet = fleet_of({"a": {"m1"}, "b": {"m2"}})
    key = key_for_json("/v1/completions", {"model": "m2", "prompt": "shared document " * 100})
    fleet.index.record("a", key.blocks())  # (as if) its prefix were cached on a
    assert make_strategy("cache_aware").choose(key, fleet).instance == "b"


def test_no_healthy_instance_for_the_model_is_its_own_error():
    fleet = fleet_of({"a": {"m1"}, "b": {"m2"}})
    fleet.instances["b"].healthy = False
    key = key_for_json("/v1/completions", {"model": "m2", "prompt": "x" * 500})
    with pytest.raises(ModelNotServed) as err:
        make_strategy("cache_aware").choose(key, fleet)
    assert err.value.model == "m2"


async def ask(router, model: str) -> tuple[int, str, dict]:
    async with aiohttp.ClientSession() as client:
        async with client.post(f"{router.url}/v1/chat/completions", json={**CHAT, "model": model}) as r:
            return r.status, r.headers.get("x-warmroute-instance", ""), await r.json()


async def test_requests_go_to_the_instances_serving_their_model_over_http():
    a = await Upstream("a", ("llama",)).start()
    b = await Upstream("b", ("qwen", "qwen-lora")).start()
    router = await router_for(a, b, models_interval=30)  # read at start-up, before the first request
    try:
        for model, where in (("llama", {"a"}), ("qwen", {"b"}), ("qwen-lora", {"b"})):
            got = {(await ask(router, model))[:2] for _ in range(8)}
            assert got == {(200, w) for w in where}, model
        status, instance, _ = await ask(router, "not-listed-anywhere")  # as before: any instance
        assert status == 200 and instance in ("a", "b")
        b.health_status = 503  # b fails its next health check: qwen has nowhere to go, llama still has a
        await router.app[HEALTH].check(router.app[UPSTREAMS].session, "b")
        assert (await ask(router, "llama"))[:2] == (200, "a")
        status, _, body = await ask(router, "qwen")
        assert status == 503 and "qwen" in body["error"]["message"]
    finally:
        await router.stop()
        await a.stop()
        await b.stop()


async def test_configured_models_win_over_what_the_instance_lists(tmp_path):
    a = await Upstream("a", ("llama", "shared")).start()
    b = await Upstream("b", ("llama",)).start()
    config = tmp_path / "warmroute.yaml"
    config.write_text(f"backends:\n  - {{name: a, url: '{a.url}', models: [special]}}\n"
                      f"  - {{name: b, url: '{b.url}'}}\n")
    from warmroute.router.server import start_router
    from warmroute.router.settings_load import load_settings

    router = await start_router(load_settings({"port": 0, "health_interval": 3600, "engine_metrics": False},
                                              config_file=config, env={}))
    try:
        assert {(await ask(router, "llama"))[1] for _ in range(8)} == {"b"}
        assert {(await ask(router, "special"))[1] for _ in range(4)} == {"a"}
    finally:
        await router.stop()
        await a.stop()
        await b.stop()


class KeyedUpstream(Upstream):
    """An engine started with an API key: its /v1/models needs the client's Authorization."""

    async def _models(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer sk-test":
            return web.json_response({"error": "unauthorized"}, status=401)
        return await super()._models(request)


async def test_a_clients_models_request_teaches_the_router_what_keyed_engines_serve():
    a, b = await KeyedUpstream("a", ("llama",)).start(), await KeyedUpstream("b", ("qwen",)).start()
    router = await router_for(a, b, models_interval=30)
    try:
        fleet = router.app[ROUTER].fleet
        assert fleet.instances["a"].models is None  # the router's own read was refused
        async with aiohttp.ClientSession() as client:
            async with client.get(f"{router.url}/v1/models", headers={"Authorization": "Bearer sk-test"}) as r:
                assert r.status == 200
                assert sorted(m["id"] for m in (await r.json())["data"]) == ["llama", "qwen"]
        assert fleet.instances["a"].models == {"llama"} and fleet.instances["b"].models == {"qwen"}
        assert {(await ask(router, "qwen"))[1] for _ in range(8)} == {"b"}
        router.app[CATALOG].learn("a", None)  # a failed read later changes nothing
        assert fleet.instances["a"].models == {"llama"}
    finally:
        await router.stop()
        await a.stop()
        await b.stop()
