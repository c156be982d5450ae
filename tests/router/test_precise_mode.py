"""Precise mode through the router: settings, the exact index deciding where an instance's events are in step,
the approximate model where they are not, and what the router says about it (headers, access log, /metrics).
The instances are stubs; each has a real ZMQ publisher on 127.0.0.1 (the emulated engine's) that the test
drives as the engine would."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import msgspec
import pytest
import zmq
from tokenizers import Tokenizer

from client_helpers import wait_for
from fake_upstream import Upstream
from warmroute.bench.tiny_tokenizer import write_model_dir
from warmroute.engine.kv_events import KvEventPublisher
from warmroute.errors import UsageError
from warmroute.router.app import CATALOG, KV_EVENTS, ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

BS = 4  # tokens a block, as the publishers report


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    write_model_dir(d)
    return d


def chat(doc: int, question: int) -> dict:
    system = f"doc {doc} " + " ".join(["the cache of a prefix holds keys and values"] * 30)
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": f"question {question} so later turns"}]}


def engine_tokens(model_dir, body: dict) -> list[int]:
    """What the engine would tokenize: the ChatML text, written out here rather than rendered by the router."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in body["messages"])
    text += "<|im_start|>assistant\n"
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


class Instance:
    def __init__(self, name: str, replay: bool = True) -> None:
        self.name = name
        self.pub = KvEventPublisher("tcp://127.0.0.1:0", "kv", "tcp://127.0.0.1:0" if replay else None, bind=True)
        self.next_hash = hash(name) & 0xFFFF_FFFF

    def store(self, tokens: list[int], lora: str | None = None) -> int:
        """Report the prompt's full blocks stored, as one event chain; returns the tokens reported."""
        n = len(tokens) // BS
        hashes = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        self.pub.stored(hashes, None, tokens[: n * BS], BS, lora)
        self.pub.flush()
        return n * BS

    def backend(self, stub: Upstream) -> dict:
        entry = {"name": self.name, "url": stub.url, "kv_events_endpoint": self.pub.endpoint}
        if self.pub.replay_endpoint:
            entry["kv_events_replay_endpoint"] = self.pub.replay_endpoint
        return entry


@pytest.fixture
async def fleet(model_dir):
    stubs = [await Upstream(n, models=None).start() for n in ("a", "b")]
    instances = [Instance("a"), Instance("b", replay=False)]
    for i in instances:
        await i.pub.start()
    router = await start_router(load_settings({
        "backends": [i.backend(s) for i, s in zip(instances, stubs)], "port": 0, "kv_events": True,
        "tokenizer": str(model_dir), "kv_events_topic": "kv", "health_interval": 3600, "engine_metrics": False,
        "models_interval": 0}, env={}))
    yield router, instances
    await router.stop()
    for i in instances:
        await i.pub.close()
    for s in stubs:
        await s.stop()


async def in_step(router, inst: Instance) -> None:
    """Publish AllBlocksCleared until the subscriber (which joins after batch 0) is in step again."""
    exact = router.app[ROUTER].exact
    for _ in range(250):
        if inst.name in exact.fresh:
            return
        inst.pub.cleared()
        inst.pub.flush()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{inst.name} never in step")


async def post(client, router, body) -> tuple[str, str]:
    async with client.post(router.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-warmroute-instance"], r.headers["x-warmroute-reason"]


def sample(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_events_decide_where_in_step_and_the_model_elsewhere(fleet, model_dir):
    router, (a, b) = fleet
    await in_step(router, a)
    await in_step(router, b)
    exact = router.app[ROUTER].exact
    async with aiohttp.ClientSession() as client:
        body = chat(1, 0)
        reported = b.store(engine_tokens(model_dir, body))  # b says it holds this prompt; the router never sent it
        await wait_for(lambda: exact.size("b") == reported // BS)
        assert await post(client, router, chat(1, 1)) == ("b", "cache_hit; match=precise")
        # a's cache is empty, by its own account: the same document goes to b again, not by a guess
        assert await post(client, router, chat(1, 2)) == ("b", "cache_hit; match=precise")

        # b's stream loses a batch and it has no replay: stale, the approximate model decides for it
        b.pub.publish_raw(b"\xc1 garbage")  # counted and skipped
        b.pub.seq += 1  # a batch lost on the way
        b.store([7] * BS)
        await wait_for(lambda: "b" not in exact.fresh)
        # a's events say it does not hold document 1; b's model (the two requests sent there) says b does
        assert await post(client, router, chat(1, 4)) == ("b", "cache_hit; match=approximate")
        async with client.get(router.url + "/metrics") as r:
            text = await r.text()
        assert sample(text, "warmroute_kv_events_stale", backend="b") == 1
        assert sample(text, "warmroute_kv_events_stale", backend="a") == 0
        assert sample(text, "warmroute_kv_events_gaps_total", backend="b", kind="gap") == 1
        assert sample(text, "warmroute_kv_events_bad_total", backend="b") >= 1
        assert sample(text, "warmroute_kv_events_applied_total", backend="b") >= 1
        assert sample(text, "warmroute_kv_index_blocks", backend="b") >= reported // BS

        await in_step(router, b)  # its engine cleared its cache: in step again, and it holds nothing
        assert (await post(client, router, chat(1, 3)))[1] == "cold; match=precise"


def test_precise_mode_settings_fail_clearly(model_dir, tmp_path, monkeypatch):
    base = {"backends": ["http://127.0.0.1:9"], "kv_events": True}
    with pytest.raises(UsageError, match="needs a tokenizer"):
        load_settings(base, env={})
    with pytest.raises(UsageError, match="needs strategy cache_aware"):
        load_settings({**base, "tokenizer": str(model_dir), "strategy": "random"}, env={})
    with pytest.raises(UsageError, match="cannot load a tokenizer"):
        load_settings({**base, "tokenizer": str(tmp_path)}, env={})
    with pytest.raises(UsageError, match="chat template .*missing.jinja' looks like a file path"):
        load_settings({**base, "tokenizer": str(model_dir), "chat_template": str(tmp_path / "missing.jinja")}, env={})
    (tmp_path / "other.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_settings({**base, "tokenizer": str(model_dir), "chat_template": str(tmp_path / "other.jinja")},
                         env={}).chat_template == str(tmp_path / "other.jinja")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zmq" else real(name, *a))
    with pytest.raises(UsageError, match="pyzmq package"):
        load_settings({**base, "tokenizer": str(model_dir)}, env={})


async def test_adapter_requests_match_the_blocks_stored_for_that_adapter(fleet, model_dir):
    router, (a, b) = fleet
    await in_step(router, a)
    await in_step(router, b)
    exact = router.app[ROUTER].exact
    router.app[CATALOG].learn("a", [{"id": "m"}, {"id": "sql-lora", "parent": "m"}])  # as vLLM lists adapters
    body = chat(5, 0)
    reported = b.store(engine_tokens(model_dir, body), lora="sql-lora")
    reported += a.store(engine_tokens(model_dir, body))  # the base model's blocks, at the other instance
    await wait_for(lambda: exact.size("a") + exact.size("b") == reported // BS)
    async with aiohttp.ClientSession() as client:
        assert await post(client, router, {**chat(5, 1), "model": "sql-lora"}) == ("b", "cache_hit; match=precise")
        assert await post(client, router, chat(5, 2)) == ("a", "cache_hit; match=precise")


async def test_subscribers_follow_membership(model_dir):
    """An instance added through the admin API gets its subscriber (and its events decide); removed, it goes."""
    stub = await Upstream("c", models=None).start()
    inst = Instance("c")
    await inst.pub.start()
    router = await start_router(load_settings({
        "admin_token": "t0ken", "port": 0, "kv_events": True, "tokenizer": str(model_dir), "kv_events_port": 0,
        "health_interval": 3600, "engine_metrics": False, "models_interval": 0}, env={}))
    headers = {"Authorization": "Bearer t0ken"}
    sources = router.app[KV_EVENTS]
    try:
        async with aiohttp.ClientSession() as client:
            async with client.post(router.url + "/admin/instances", json=inst.backend(stub), headers=headers) as r:
                assert r.status in (200, 201), await r.text()
            assert set(sources.subscribers) == {"c"}
            await in_step(router, inst)
            reported = inst.store(engine_tokens(model_dir, chat(3, 0)))
            await wait_for(lambda: router.app[ROUTER].exact.size("c") == reported // BS)
            assert await post(client, router, chat(3, 1)) == ("c", "cache_hit; match=precise")
            async with client.delete(router.url + "/admin/instances/c", headers=headers) as r:
                assert r.status == 200, await r.text()
            assert sources.subscribers == {} and "c" not in router.app[ROUTER].exact.instances
    finally:
        await router.stop()
        await inst.pub.close()
        await stub.stop()


async def test_a_router_started_after_its_engines_decides_exactly_from_its_first_request(model_dir):
    stubs = [await Upstream(n, models=None).start() for n in ("a", "b")]
    instances = [Instance("a"), Instance("b")]
    for i in instances:
        await i.pub.start()
    body = chat(7, 0)
    instances[1].store(engine_tokens(model_dir, body))  # before any router listens: only replay has it
    router = await start_router(load_settings({
        "backends": [i.backend(s) for i, s in zip(instances, stubs)], "port": 0, "kv_events": True,
        "tokenizer": str(model_dir), "health_interval": 3600, "engine_metrics": False, "models_interval": 0},
        env={}))
    try:
        async with aiohttp.ClientSession() as client:
            assert await post(client, router, chat(7, 1)) == ("b", "cache_hit; match=precise")
    finally:
        await router.stop()
        for i in instances:
            await i.pub.close()
        for s in stubs:
            await s.stop()


async def test_an_eviction_the_model_cannot_see_is_believed(fleet, model_dir):
    """The engine evicts a document the router sent it (its own memory pressure): the model would still count it
    held; the events say it is gone, so the next request for it is a cold one, not a predicted hit."""
    router, (a, b) = fleet
    await in_step(router, a)
    await in_step(router, b)
    exact = router.app[ROUTER].exact
    async with aiohttp.ClientSession() as client:
        first = await post(client, router, chat(9, 0))
        holder = a if first[0] == "a" else b
        stored = holder.store(engine_tokens(model_dir, chat(9, 0)))
        await wait_for(lambda: exact.size(holder.name) == stored // BS)
        assert await post(client, router, chat(9, 1)) == (holder.name, "cache_hit; match=precise")
        holder.pub.removed(list(range(holder.next_hash - stored // BS, holder.next_hash)))
        holder.pub.flush()
        await wait_for(lambda: exact.size(holder.name) == 0)
        await asyncio.sleep(router.app[ROUTER].settings.kv_speculative_ttl)  # the requests' own entries expire
        assert (await post(client, router, chat(9, 2)))[1] == "cold; match=precise"
        assert router.app[ROUTER].fleet.index.match_depths(  # the model alone would have said: held
            router.app[ROUTER].key_of("/v1/chat/completions", json.dumps(chat(9, 3)).encode(), None).blocks())


async def test_a_request_the_router_cannot_tokenize_is_still_served(tmp_path, caplog):
    """The model directory as current transformers writes it (the template in chat_template.jinja only): chat
    requests are matched exactly; one the template refuses (the engine might not: it may be given another
    template) is routed on the approximate model, said so, counted and logged once -- never refused."""
    import logging

    from warmroute.bench.tiny_tokenizer import CHATML

    write_model_dir(tmp_path, template=None)
    picky = "{% for m in messages %}{% if m['role'] == 'critic' %}{{ raise_exception('no critics') }}{% endif %}" \
            "{% endfor %}" + CHATML
    (tmp_path / "chat_template.jinja").write_text(picky)
    stub = await Upstream("a", models=None).start()
    inst = Instance("a")
    await inst.pub.start()
    router = await start_router(load_settings({
        "backends": [inst.backend(stub)], "port": 0, "kv_events": True, "tokenizer": str(tmp_path),
        "kv_events_topic": "kv", "health_interval": 3600, "engine_metrics": False, "models_interval": 0}, env={}))
    try:
        await in_step(router, inst)
        reported = inst.store(engine_tokens(tmp_path, chat(4, 0)))
        await wait_for(lambda: router.app[ROUTER].exact.size("a") == reported // BS)
        async with aiohttp.ClientSession() as client:
            assert await post(client, router, chat(4, 1)) == ("a", "cache_hit; match=precise")
            critic = {"model": "m", "messages": [{"role": "critic", "content": "too long"}]}
            caplog.set_level(logging.WARNING, logger="warmroute.router")
            for _ in range(3):
                async with client.post(router.url + "/v1/chat/completions", json=critic) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-warmroute-reason"].endswith("; match=approximate; tokenize_failed")
            async with client.get(router.url + "/metrics") as r:
                text = await r.text()
        assert sample(text, "warmroute_precise_untokenized_total", cause="template_refused") == 3
        said = [r.getMessage() for r in caplog.records if "could not be tokenized" in r.getMessage()]
        assert len(said) == 1 and "template_refused" in said[0] and "no critics" in said[0]
    finally:
        await router.stop()
        await inst.pub.close()
        await stub.stop()
