"""The emulated engine over real HTTP on 127.0.0.1: responses, streaming, caching, metrics, errors, cancel."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from client_helpers import wait_for
from warmroute.cli import main
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import Fleet, start_fleet

SYSTEM = "You are a careful assistant. Follow the policy below to the letter. " * 40  # ≈ 700 tokens


def chat(user: str, max_tokens: int = 4, **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, **extra}


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = await start_fleet(2, config=EngineConfig.from_profile("8b", kv_capacity_tokens=64_000), time_scale=0.02)
    yield f
    await f.close()


async def post(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, dict]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def sse_events(resp: aiohttp.ClientResponse) -> list[dict | str]:
    events: list[dict | str] = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            payload = line[6:].strip().decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_chat_completion(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    status, body = await post(http, fleet.urls[0] + "/v1/chat/completions", chat("hello", max_tokens=5))
    assert status == 200
    assert body["object"] == "chat.completion" and body["model"] == "warmroute-emulated"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] > 600
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_streamed_completion(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "Once upon a time " * 50, "stream": True, "max_completion_tokens": 6}
    async with http.post(fleet.urls[1] + "/v1/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert len(texts) == 6 and all(t.strip() for t in texts)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_streamed_chat_carries_role_then_content(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    async with http.post(fleet.urls[0] + "/v1/chat/completions", json=chat("hi", 3, stream=True)) as resp:
        events = await sse_events(resp)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert deltas[0]["role"] == "assistant" and "".join(d.get("content", "") for d in deltas).split() == \
        ["lorem", "ipsum", "dolor"]
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_repeated_prompt_reports_cached_tokens_and_answers_sooner(fleet: Fleet,
                                                                        http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0] + "/v1/chat/completions"
    long_chat = chat("what now?", max_tokens=1)
    long_chat["messages"][0]["content"] = SYSTEM * 6  # ≈ 4,300 tokens: 1.1 s of cold prefill (22 ms scaled)
    timings, cached = [], []
    for _ in range(2):
        start = time.perf_counter()
        status, body = await post(http, url, long_chat)
        timings.append(time.perf_counter() - start)
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    prompt = body["usage"]["prompt_tokens"]
    assert cached == [0, (prompt - 1) // 16 * 16]  # whole 16-token blocks, the last token recomputed
    assert timings[1] < timings[0] / 2
    _, other = await post(http, fleet.urls[1] + "/v1/chat/completions", long_chat)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # each instance has its own cache


async def test_the_prompt_is_the_model_s_tokens(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    """usage.prompt_tokens is the tokenizer's count of the rendered template, and a /v1/completions prompt of
    the same token ids (or of the rendered text) hits the blocks the chat request computed: the cache is of
    tokens, whichever route and form brought them."""
    tokenizer = fleet.servers[0].tokenizer
    body = chat("what is in the policy?", max_tokens=1)
    ids = tokenizer.chat_ids(body)
    assert ids == tokenizer.encode(tokenizer.render_chat(body["messages"]), add_special_tokens=False)
    status, reply = await post(http, fleet.urls[0] + "/v1/chat/completions", body)
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(ids)
    full = (len(ids) - 1) // 16 * 16
    for prompt in (ids, [ids], tokenizer.render_chat(body["messages"])):
        status, reply = await post(http, fleet.urls[0] + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert status == 200 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] == full, prompt
    shorter = ids[: len(ids) - 40]  # shares all but the blocks the last 40 tokens touch
    _, reply = await post(http, fleet.urls[0] + "/v1/completions", {"prompt": shorter, "max_tokens": 1})
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(shorter) - 1) // 16 * 16


async def test_cache_salt_separates_caches(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[1] + "/v1/chat/completions"
    cached = []
    for salt in ("tenant-a", "tenant-b", "tenant-a", None):
        body = chat("salted", max_tokens=1, **({"cache_salt": salt} if salt else {}))
        _, reply = await post(http, url, body)
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == cached[1] == cached[3] == 0 and cached[2] > 600


async def test_metrics_count_prefix_tokens_under_vllm_names(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    prompt_tokens = cached_tokens = 0
    for user in ("a", "b", "a"):
        _, body = await post(http, url + "/v1/chat/completions", chat(user))
        prompt_tokens += body["usage"]["prompt_tokens"]
        cached_tokens += body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached_tokens > 0
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    label = '{model_name="warmroute-emulated"}'
    assert samples[f"vllm:prefix_cache_queries_total{label}"] == prompt_tokens
    assert samples[f"vllm:prefix_cache_hits_total{label}"] == cached_tokens
    assert samples[f"vllm:num_requests_running{label}"] == 0
    assert samples[f"vllm:num_requests_waiting{label}"] == 0
    assert samples[f"vllm:kv_cache_usage_perc{label}"] == 0
    assert samples['vllm:request_success_total{finished_reason="length",model_name="warmroute-emulated"}'] == 3
    assert samples['vllm:cache_config_info{block_size="16",model_name="warmroute-emulated",'
                   'num_gpu_blocks="4000"}'] == 1


async def test_bad_requests_get_a_json_400(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    async with http.post(url + "/v1/chat/completions", data=b"{not json") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    for path, body in (("/v1/chat/completions", {"messages": "hi"}),
                       ("/v1/chat/completions", [1, 2]),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": [image]}]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": 7}),
                       ("/v1/completions", {"prompt": ["one", "two"]}),
                       ("/v1/completions", {"prompt": [1, -2]}),
                       ("/v1/completions", {"prompt": {"text": "x"}}),
                       ("/v1/completions", {"max_tokens": 3}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
                       ("/v1/completions", {"prompt": "x", "stream": "yes"}),
                       ("/v1/completions", {"prompt": "x" * 300_000}),  # more than the KV cache holds
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 10_000_000}]})):
        status, reply = await post(http, url + path, body)
        assert status == 400 and reply["error"]["message"], (path, body)
    assert fleet.servers[0].model.stats.requests_submitted == 0


async def test_informational_routes(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[1]
    async with http.get(url + "/health") as resp:
        assert resp.status == 200
    async with http.get(url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["warmroute-emulated"]
    async with http.get(url + "/get_model_info") as resp:
        info = await resp.json()
        assert info["model_path"] == "warmroute-emulated" and info["is_generation"] is True
    async with http.get(url + "/get_server_info") as resp:
        assert (await resp.json())["name"] == "engine-1"


async def test_client_disconnect_cancels_the_sequence(http: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(1, time_scale=1.0)  # real time: 10,000 tokens take minutes
    model = fleet.servers[0].model
    try:
        url = fleet.urls[0] + "/v1/chat/completions"
        waiting = asyncio.create_task(post(http, url, chat("wait", max_tokens=10_000)))
        await wait_for(lambda: model.num_running == 1)
        waiting.cancel()  # closes the connection
        await wait_for(lambda: model.idle)
        async with http.post(url, json=chat("stream", max_tokens=10_000, stream=True)) as resp:
            await resp.content.readline()  # the first token arrived
            assert model.num_running == 1
        await wait_for(lambda: model.idle)
        assert model.stats.requests_cancelled == 2 and model.stats.requests_finished == 0
        assert model.kv_usage == 0
    finally:
        await fleet.close()


def test_cli_rejects_bad_settings_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert main(["engine", "--count", "2", "--port", "65535"]) == 2
    assert main(["engine", "--block-size", "0"]) == 2
    assert main(["engine", "--tokenizer", str(tmp_path)]) == 2  # no tokenizer.json there
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("warmroute engine: error: ") for line in err)
    assert "cannot load a tokenizer" in err[2]


async def test_requests_arriving_during_a_decode_stretch_pay_their_full_prefill(
        http: aiohttp.ClientSession) -> None:
    """Regression: a request arriving mid-stretch used to be prefilled in the stretch's remaining sleep (first
    token far too early), which also left the driver's deadline ahead of the clock until it crashed."""
    config = EngineConfig.from_profile("8b", kv_capacity_tokens=64_000)
    fleet = await start_fleet(1, config=config, time_scale=0.5)
    try:
        url = fleet.urls[0] + "/v1/chat/completions"
        long_run = asyncio.create_task(post(http, url, chat("long", max_tokens=400)))
        await asyncio.sleep(0.5)  # its prefill is done: the driver is in fused decode stretches
        prompt = "unique words never cached before " * 480  # ≈ 5,300 tokens: 30 + 0.25 ms each ≈ 1.4 s
        for i in range(3):
            tokenizer = fleet.servers[0].tokenizer  # the new tokens: the system prompt is cached
            n = len(tokenizer.chat_ids(chat(f"{i} {prompt}"))) - len(tokenizer.chat_ids(chat("")))
            expected_s = 0.5 * config.timing.step_ms(config.timing.prefill_ms(n, n), True, 1) / 1000
            t0 = time.perf_counter()
            async with http.post(url, json=chat(f"{i} {prompt}", max_tokens=2, stream=True)) as resp:
                await resp.content.readline()
                ttft = time.perf_counter() - t0
                await resp.read()
            assert resp.status == 200 and ttft >= 0.8 * expected_s, (ttft, expected_s)
        status, body = await long_run
        assert status == 200 and body["usage"]["completion_tokens"] == 400
    finally:
        await fleet.close()


async def test_an_engine_held_up_by_its_host_says_how_far_it_fell_behind(http: aiohttp.ClientSession) -> None:
    """A busy host delays the emulated engine's steps; past MAX_LAG_S the lag is skipped, not repaid, and counted,
    so a benchmark can tell that its timings were the host's rather than the engine's it models."""
    fleet = await start_fleet(1, config=EngineConfig.from_profile("8b", kv_capacity_tokens=64_000), time_scale=0.5)
    try:
        url = fleet.urls[0]
        async with http.post(url + "/v1/chat/completions", json=chat("go", max_tokens=300, stream=True)) as resp:
            await resp.content.readline()  # its first token: ~1.8 s of decoding left
            time.sleep(0.5)  # the event loop, the engine's driver included, held up as on an overloaded host
            await resp.read()
        assert resp.status == 200
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
        behind = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("warmroute_emulation_behind_seconds_total{")]
        assert behind and behind[0] >= 0.3, text
    finally:
        await fleet.close()
