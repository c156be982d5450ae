"""Engine feedback end to end: a router that believes an instance's KV cache 64x larger than it is predicts
hits the engine has evicted; the engine's reported cached tokens (plain and streamed responses) correct it."""

from __future__ import annotations


import aiohttp

from client_helpers import ask
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import start_fleet
from warmroute.router.app import ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

ENGINE_KV = 4096  # tokens: about three of the documents below (~1,370 real tokens each; the router guesses ~750)
ROUTER_KV = 64 * ENGINE_KV
DOCS = 6  # cycled in order: the engine's LRU cache never holds the next one


def _chat(doc: int, question: int, stream: bool) -> dict:
    text = f"Document {doc}. " + "".join(f"Clause {doc}.{i} binds party {i % 5}. " for i in range(110))
    return {"model": "warmroute-emulated", "max_tokens": 2, "stream": stream,
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": f"Question {question}?"}]}


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def _overpredicted(client: aiohttp.ClientSession, url: str) -> float:
    async with client.get(url + "/metrics") as r:
        return _sample(await r.text(), 'warmroute_index_feedback_total{backend="e0",verdict="overpredicted"}')


async def test_predicted_hits_the_engine_evicted_shrink_the_index_until_predictions_match():
    engines = await start_fleet(1, config=EngineConfig.from_profile("8b", kv_capacity_tokens=ENGINE_KV),
                                time_scale=0.02)
    router = await start_router(load_settings({
        "backends": [f"e0={engines.urls[0]}"], "port": 0, "strategy": "cache_aware",
        "kv_capacity_tokens": ROUTER_KV, "health_interval": 3600, "engine_metrics": False}, env={}))
    fleet = router.app[ROUTER].fleet
    try:
        async with aiohttp.ClientSession() as client:
            for doc in range(DOCS):  # first sight: cold everywhere
                assert (await ask(client, router.url, _chat(doc, 0, stream=False)))[1:3] == ("cold", 0)
            # The index (64x too large) still holds all of document 0; the engine kept only its head.
            _, reason, cached, prompt = await ask(client, router.url, _chat(0, 1, stream=True))
            assert reason == "cache_hit" and cached < prompt / 2
            assert fleet.cache_scale.value < 1  # corrected from the streamed response's usage chunk
            overs = [await _overpredicted(client, router.url)]
            for question in range(2, 40):
                for doc in range(DOCS):
                    await ask(client, router.url, _chat(doc, question, stream=doc % 2 == 0))
                overs.append(await _overpredicted(client, router.url))
                if overs[-1] == overs[-2]:
                    break
            # Corrected: a whole round of requests without one predicted hit the engine did not have ...
            assert overs[-1] == overs[-2] >= 10, overs
            assert fleet.cache_scale.value < 1 / 8
            # ... and the hits it has are still predicted: the document just sent, asked again.
            _, reason, cached, prompt = await ask(client, router.url, _chat(DOCS - 1, 99, stream=False))
            assert reason == "cache_hit" and cached > 0.8 * prompt
            async with client.get(router.url + "/metrics") as r:
                text = await r.text()
        cached_total = _sample(text, 'warmroute_engine_cached_tokens_total{backend="e0"}')
        predicted_total = _sample(text, 'warmroute_predicted_cached_tokens_total{backend="e0"}')
        prompt_total = _sample(text, 'warmroute_engine_prompt_tokens_total{backend="e0"}')
        assert 0 < cached_total < predicted_total < prompt_total
        # Each response's error lands in the histogram; the overpredicted ones above zero.
        errors = _sample(text, 'warmroute_prediction_error_ratio_count{mode="approximate"}')
        at_most_zero = _sample(text, 'warmroute_prediction_error_ratio_bucket{le="0.0",mode="approximate"}')
        assert errors >= DOCS * 2 and errors - at_most_zero >= 10
        assert 0 < _sample(text, "warmroute_index_capacity_scale ") < 1 / 8
    finally:
        await router.stop()
        await engines.close()
