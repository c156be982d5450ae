"""Disaggregated prefill/decode end to end: `warmroute serve` in front of emulated engines that move KV as vLLM's
NixlConnector does, and as SGLang's bootstrap rooms do (warmroute/engine/kv_transfer.py). Every request answered
with the aggregated engine's text, the decode instance's own metrics showing the prompt arrived by transfer, and
the prefill pool keeping its prefixes."""

from __future__ import annotations

import json

import aiohttp
import pytest

from warmroute.engine.kv_transfer import TransferConfig
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import start_fleet
from warmroute.prometheus_text import read_samples
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

TIME_SCALE = 0.02
CONFIG = EngineConfig.from_profile("8b", kv_capacity_tokens=200_000)


def chat(doc: int, question: int, stream: bool = False) -> dict:
    system = f"Document {doc}. " + "".join(f"Clause {doc}.{i}: the parties agree to term {i * 7 + doc}. "
                                           for i in range(120))
    return {"model": "warmroute-emulated", "max_tokens": 6, "stream": stream, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Question {question}: what does clause {question} say?"}]}


async def answer(client: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict[str, str], str]:
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        if body.get("stream"):  # the text of the deltas
            events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: {")]
            text = "".join(c["delta"].get("content") or "" for e in events for c in json.loads(e)["choices"])
            return r.status, dict(r.headers), text
        return r.status, dict(r.headers), (await r.json())["choices"][0]["message"]["content"]


BY_SOURCE = "vllm:prompt_tokens_by_source_total"


async def by_source(client: aiohttp.ClientSession, url: str, source: str) -> float:
    """An engine's prompt tokens from `source` (local_compute, local_cache_hit, external_kv_transfer)."""
    async with client.get(url + "/metrics") as r:
        found = read_samples(await r.text(), (BY_SOURCE,)).get(BY_SOURCE, [])
    return sum(v for labels, v in found if labels.get("source") == source)


@pytest.fixture
async def fleets():
    made = []

    async def make(count: int, **kw):
        fleet = await start_fleet(count, config=CONFIG, time_scale=TIME_SCALE, **kw)
        made.append(fleet)
        return fleet
    yield make
    for f in made:
        await f.close()


async def test_split_requests_are_answered_as_an_aggregated_engine_answers_them_with_kv_moved(fleets):
    pd = await fleets(3, name="pd", kv_transfer=TransferConfig("nixl"))
    alone = await fleets(1, name="agg")
    p0, p1, d0 = pd.urls
    router = await start_router(load_settings({
        "backends": [f"prefill@p0={p0}", f"prefill@p1={p1}", f"decode@d0={d0}"], "port": 0,
        "health_interval": 3600, "pd_threshold_tokens": 0}, env={}))  # 0: split even what d0 holds
    try:
        async with aiohttp.ClientSession() as client:
            homes: dict[int, str] = {}
            for question in range(3):
                for doc in range(4):
                    body = chat(doc + 10 * question, question, stream=question == 1)  # a new document each
                    status, headers, text = await answer(client, router.url, body)
                    assert status == 200 and headers["x-warmroute-instance"] == "d0"
                    assert "pd=split" in headers["x-warmroute-reason"]
                    homes[doc] = headers["x-warmroute-prefill-instance"]
                    _, _, expected = await answer(client, alone.urls[0], body)
                    assert text == expected
            moved = await by_source(client, d0, "external_kv_transfer")
            computed = await by_source(client, d0, "local_compute")
            assert moved > 12 * 500 and computed < 0.01 * moved  # 12 prompts of 1,000+ tokens: moved, not computed
            # The same documents again: each prefilled where it was, from its cache (d0 holds them too, so the
            # default threshold would send them whole).
            for doc in range(4):
                body = {**chat(doc + 20, 9), "max_tokens": 2}
                _, headers, _ = await answer(client, router.url, body)
                assert headers["x-warmroute-prefill-instance"] == homes[doc]
            state = await (await client.get(router.url + "/dashboard/state")).json()
            assert state["disaggregation"]["prefill_hit_rate"] > 0.2  # 4 of 16 prefill legs repeats, nearly all cached
    finally:
        await router.stop()


async def test_sglang_bootstrap_legs_go_together_and_the_decode_instance_answers(fleets):
    prefill = await fleets(1, name="p", kv_transfer=TransferConfig("bootstrap", role="prefill"), bootstrap_port=0)
    decode = await fleets(1, name="d", kv_transfer=TransferConfig("bootstrap", role="decode"))
    port = prefill.servers[0].bootstrap_port
    router = await start_router(load_settings({
        "backends": [{"name": "p0", "url": prefill.urls[0], "role": "prefill", "bootstrap_port": port},
                     {"name": "d0", "url": decode.urls[0], "role": "decode"}],
        "port": 0, "health_interval": 3600, "pd_threshold_tokens": 256, "pd_transfer": "bootstrap"}, env={}))
    try:
        async with aiohttp.ClientSession() as client:
            status, headers, text = await answer(client, router.url, chat(1, 1))
            assert status == 200 and text and headers["x-warmroute-prefill-instance"] == "p0"
            assert await by_source(client, decode.urls[0], "external_kv_transfer") > 0
    finally:
        await router.stop()
