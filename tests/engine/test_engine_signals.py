"""Engine load signals: parsing vLLM's and SGLang's /metrics, folding them into cache_aware's cost, and the
scraper against an emulated engine and broken ones."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from fake_upstream import Upstream

from warmroute.core.engine_load import EngineLoad, backlog_tokens, observe
from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.routing_key import key_for_json
from warmroute.core.strategies import StrategySettings, make_strategy
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import start_fleet
from warmroute.router.app import ROUTER, SCRAPER, UPSTREAMS
from warmroute.router.engine_metrics import EngineSignals, MalformedMetrics, parse_engine_metrics
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 5.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.5
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama"} 1.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="27000"} 1.0
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:max_total_num_tokens Maximum total number of tokens.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 161721.0
# HELP sglang:cache_hit_rate The cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
"""


# -- parsing ------------------------------------------------------------------------------------------------------
def test_vllm_counts_are_summed_over_ranks_usage_is_the_busiest_and_capacity_from_cache_config():
    assert parse_engine_metrics(VLLM) == EngineSignals(waiting=3, running=7, kv_usage=0.5, capacity_tokens=432_000)


def test_sglang_names():
    assert parse_engine_metrics(SGLANG) == EngineSignals(waiting=4, running=12, kv_usage=0.28,
                                                          capacity_tokens=161_721)


def test_the_emulated_engines_own_page_parses():
    from warmroute.engine.metrics import EngineMetrics
    from warmroute.engine.model import EngineModel

    model = EngineModel(EngineConfig.from_profile("8b", kv_capacity_tokens=32_000))
    signals = parse_engine_metrics(EngineMetrics(model, "m").render().decode())
    assert signals == EngineSignals(waiting=0, running=0, kv_usage=0.0, capacity_tokens=32_000)


@pytest.mark.parametrize("text", [
    "vllm:num_requests_running{model_name=\"m\" 3\n",  # unclosed labels
    "vllm:num_requests_waiting three\n",
])
def test_malformed_lines_we_read_raise(text):
    with pytest.raises(MalformedMetrics):
        parse_engine_metrics(text)


@pytest.mark.parametrize("text", [
    "",
    "# a page of other metrics\nprocess_cpu_seconds_total 12.5\n",
    "garbage that is not ours\n",  # lines we do not read cannot break the scrape
    'vllm:num_requests_running{m="a"} NaN\nvllm:kv_cache_usage_perc{m="a"} -1\n',  # dropped, as if missing
    'vllm:cache_config_info{block_size="16"} 1\n',  # no num_gpu_blocks: no capacity
])
def test_missing_signals_are_none(text):
    signals = parse_engine_metrics(text)
    assert not signals.has_load and signals.capacity_tokens is None


# -- the core: foreign load and the cost -------------------------------------------------------------------------
def test_observe_counts_only_what_this_router_did_not_send():
    assert observe(3, 7, 0.5, own_inflight=10, own_pending=4) == EngineLoad(3, 7, 0.5, 0.0, 0.0)
    load = observe(9, 7, 0.5, own_inflight=10, own_pending=4)  # another router queued 6 more
    assert (load.foreign_requests, load.foreign_waiting) == (6.0, 5.0)
    assert observe(None, None, 2.0, 0, 0) == EngineLoad(None, None, 1.0, 0.0, 0.0)


def test_backlog_charges_foreign_waiting_requests_and_prompt_that_does_not_fit_in_free_kv():
    assert backlog_tokens(None, 4000, 10_000, 500.0) == 0.0
    assert backlog_tokens(EngineLoad(5, 0, None, 5, 5), 4000, 10_000, 500.0) == 2500.0
    assert backlog_tokens(EngineLoad(0, 3, 0.9, 0, 0), 4000, 10_000, 500.0) == pytest.approx(3000.0)
    assert backlog_tokens(EngineLoad(0, 3, 0.1, 0, 0), 4000, 10_000, 500.0) == 0.0


def _fleet() -> Fleet:
    f = Fleet(FleetSettings())
    for name in ("a", "b", "c"):
        f.add(name, 200_000)
    return f


def _key(doc: str, q: str = "q"):
    return key_for_json("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": doc * 200}, {"role": "user", "content": q}]})


def test_without_engine_signals_the_decision_is_unchanged():
    s = make_strategy("cache_aware", StrategySettings())
    f, g = _fleet(), _fleet()
    g.engine_load("a", None, None, None)
    for i in range(30):
        k = _key(f"doc {i % 7}. ", str(i))
        da, db = s.choose(k, f), s.choose(k, g)
        assert da == db
        for fl, d in ((f, da), (g, db)):
            fl.dispatched(d.instance, d.uncached_tokens, list(d.blocks))


def test_other_routers_queue_on_the_warm_instance_sends_a_request_elsewhere():
    s = make_strategy("cache_aware", StrategySettings())
    f = _fleet()
    first = s.choose(_key("policy. "), f)
    f.dispatched(first.instance, first.uncached_tokens, list(first.blocks))
    f.first_token(first.instance, first.uncached_tokens)
    f.finished(first.instance, first.uncached_tokens)
    assert s.choose(_key("policy. ", "again"), f).instance == first.instance  # warm, idle: back there
    f.mean_uncached_tokens = 2000.0
    f.engine_load(first.instance, waiting=40, running=64, kv_usage=0.95)  # what other routers sent there
    assert s.choose(_key("policy. ", "again"), f).instance != first.instance


# -- the scraper -------------------------------------------------------------------------------------------------
async def _broken_engines() -> dict[str, Upstream]:
    """Stand-in engines: one answers 404 on /metrics, one malformed text, one its load but no KV capacity."""
    pages = {"notfound": (404, "ok"), "malformed": (200, "vllm:num_requests_waiting x y z\n"),
             "nocap": (200, "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\n")}
    started = {}
    for name, (status, text) in pages.items():
        async def metrics(request: web.Request, status: int = status, text: str = text) -> web.Response:
            return web.Response(status=status if request.path == "/metrics" else 404, text=text)
        started[name] = await Upstream(name, models=None).start()
        started[name].behaviour = metrics
    return started


async def test_scraper_reads_an_emulated_engine_and_counts_broken_ones(caplog):
    caplog.set_level("INFO", logger="warmroute.router")
    engines = await start_fleet(1, config=EngineConfig.from_profile("8b", kv_capacity_tokens=48_000),
                                time_scale=0.02)
    broken = await _broken_engines()
    router = await start_router(load_settings({
        "backends": [f"e0={engines.urls[0]}", *(f"{n}={u.url}" for n, u in broken.items()),
                     "refused=http://127.0.0.1:9"],
        "port": 0, "health_interval": 3600, "engine_metrics_interval": 3600}, env={}))
    try:
        fleet = router.app[ROUTER].fleet
        e0 = fleet.instances["e0"]
        # The first scrape ran before the router accepted requests: the engine's capacity replaced the default.
        assert e0.kv_capacity_tokens == 48_000 and fleet.instances["notfound"].kv_capacity_tokens == 1_000_000
        assert e0.engine == EngineLoad(0, 0, 0.0, 0.0, 0.0)
        assert all(fleet.instances[n].engine is None for n in ("notfound", "malformed", "refused"))
        async with aiohttp.ClientSession() as client:
            async with client.get(router.url + "/metrics") as r:
                text = await r.text()
        for instance, kind in (("notfound", "status"), ("malformed", "malformed"), ("refused", "fetch")):
            assert f'warmroute_engine_scrape_errors_total{{backend="{instance}",kind="{kind}"}} 1.0' in text
        assert 'backend="e0"' not in text.split("warmroute_engine_scrape_errors_total")[-1]
        # What the router assumes is said once per instance: the capacity learnt, or that none was found.
        await router.app[SCRAPER].scrape_all(router.app[UPSTREAMS].session)
        said = [r.getMessage() for r in caplog.records if "KV capacity" in r.getMessage()]
        assert said.count("instance e0: KV capacity 48,000 tokens, from its /metrics") == 1
        missing = [m for m in said if m.startswith("instance nocap: no KV capacity")]
        assert len(missing) == 1 and "assuming 1,000,000 tokens" in missing[0]
        assert not any(m.startswith(("instance notfound", "instance malformed", "instance refused")) for m in said)
        assert fleet.instances["nocap"].engine is not None  # its load was read all the same
    finally:
        await router.stop()
        for up in broken.values():
            await up.stop()
        await engines.close()


async def test_a_configured_capacity_is_kept_and_scraping_can_be_switched_off():
    engines = await start_fleet(1, config=EngineConfig.from_profile("8b", kv_capacity_tokens=48_000),
                                time_scale=0.02)
    try:
        for values, want_capacity, scraped in (({"kv_capacity_tokens": 64_000}, 64_000, True),
                                               ({"engine_metrics": False}, 1_000_000, False)):
            router = await start_router(load_settings({
                "backends": [f"e0={engines.urls[0]}"], "port": 0, "health_interval": 3600, **values}, env={}))
            try:
                inst = router.app[ROUTER].fleet.instances["e0"]
                assert inst.kv_capacity_tokens == want_capacity and (inst.engine is not None) == scraped
                assert router.app[SCRAPER] is not None
            finally:
                await router.stop()
    finally:
        await engines.close()
