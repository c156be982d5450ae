"""Disaggregated prefill/decode between emulated engines over real HTTP on 127.0.0.1: vLLM's NixlConnector
exchange (kv_transfer_params) by hand, and SGLang's bootstrap legs sent together."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from client_helpers import wait_for
from warmroute.cli import main
from warmroute.engine.kv_transfer import TransferConfig
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import Fleet, start_fleet

SYSTEM = "You are a careful assistant. Follow the policy below to the letter. " * 40  # ≈ 700 tokens
CONFIG = EngineConfig.from_profile("8b", kv_capacity_tokens=64_000)
SCALE = 0.02
PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}  # vLLM's toy proxy sends these
# vLLM 0.32: NixlConnector.request_finished's fields, and the scheduler's remote_prefill_cached_tokens
NIXL_FIELDS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
               "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
               "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens"}


def chat(user: str, max_tokens: int = 4, **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "max_tokens": max_tokens, **extra}


async def fleet_of(count: int = 1, **transfer: object) -> Fleet:
    config = TransferConfig(**transfer) if transfer else None  # type: ignore[arg-type]
    return await start_fleet(count, config=CONFIG, time_scale=SCALE, kv_transfer=config)


@pytest.fixture
async def nixl() -> AsyncIterator[Fleet]:
    """engine-0 prefills, engine-1 decodes (both kv_both, as vLLM's NIXL instances are)."""
    f = await fleet_of(2, mode="nixl")
    yield f
    await f.close()


async def post(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, dict]:
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def by_source(samples: dict[str, float], source: str) -> float:
    return samples[f'vllm:prompt_tokens_by_source_total{{model_name="warmroute-emulated",source="{source}"}}']


def total(samples: dict[str, float], name: str) -> float:
    return samples[f'{name}{{model_name="warmroute-emulated"}}']


async def prefill(http: aiohttp.ClientSession, fleet: Fleet, user: str) -> dict:
    status, body = await post(http, fleet.urls[0], chat(user, 1, stream=False, kv_transfer_params=PREFILL_LEG))
    assert status == 200, body
    return body


async def test_nixl_exchange_moves_the_prompt_instead_of_computing_it(nixl: Fleet,
                                                                      http: aiohttp.ClientSession) -> None:
    p, d = nixl.servers
    first = await prefill(http, nixl, "what does the policy say?")
    params, n = first["kv_transfer_params"], first["usage"]["prompt_tokens"]
    assert first["usage"]["completion_tokens"] == 1 and set(params) == NIXL_FIELDS
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == p.kv_transfer.engine_id != d.kv_transfer.engine_id
    assert params["remote_request_id"] == first["id"]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", int(p.url.rsplit(":", 1)[1]))
    assert (params["tp_size"], params["remote_num_tokens"], params["transfer_mode"]) == (1, n, "pull")
    assert params["remote_prefill_cached_tokens"] == 0
    [block_ids] = params["remote_block_ids"]
    assert len(block_ids) == -(-n // 16) == len(set(block_ids))
    assert p.model.kv_usage > 0  # held for the decode side

    body = chat("what does the policy say?", 6, kv_transfer_params=params)
    status, answer = await post(http, d.url, body)
    assert status == 200, answer
    plain = await fleet_of()
    try:
        _, reference = await post(http, plain.urls[0], chat("what does the policy say?", 6))
    finally:
        await plain.close()
    assert answer["choices"][0]["message"] == reference["choices"][0]["message"]  # same tokens as aggregated
    assert answer["usage"]["prompt_tokens"] == n and answer["usage"]["completion_tokens"] == 6
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the prefill side's hits, as vLLM says
    assert answer["kv_transfer_params"] is None
    await wait_for(lambda: p.model.kv_usage == 0)  # read: the prefill side let its blocks go

    at_d, at_p = await metrics(http, d.url), await metrics(http, p.url)
    assert by_source(at_d, "external_kv_transfer") == n and by_source(at_d, "local_compute") == 0
    assert total(at_d, "vllm:external_prefix_cache_hits_total") == n
    assert total(at_d, "vllm:nixl_xfer_time_seconds_count") == 1
    assert total(at_d, "vllm:nixl_bytes_transferred_sum") == n * 128 * 1024
    assert total(at_d, "vllm:nixl_num_failed_transfers_total") == 0
    assert by_source(at_p, "local_compute") == n and by_source(at_p, "external_kv_transfer") == 0
    assert total(at_p, "vllm:nixl_num_kv_expired_reqs_total") == 0

    _, again = await post(http, d.url, chat("what does the policy say?", 2))  # the loaded blocks are cached
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16


async def test_a_decode_instance_reads_only_what_it_does_not_hold(nixl: Fleet, http: aiohttp.ClientSession) -> None:
    d = nixl.servers[1]
    await post(http, d.url, chat("an earlier question", 1))  # the system prompt is cached at d
    first = await prefill(http, nixl, "a new question")
    status, _ = await post(http, d.url, chat("a new question", 3, kv_transfer_params=first["kv_transfer_params"]))
    assert status == 200
    at_d = await metrics(http, d.url)
    local = by_source(at_d, "local_cache_hit")
    assert 600 < local < first["usage"]["prompt_tokens"]
    assert by_source(at_d, "external_kv_transfer") == first["usage"]["prompt_tokens"] - local
    assert total(at_d, "vllm:nixl_num_descriptors_count") == 1


async def test_a_streamed_decode_leg(nixl: Fleet, http: aiohttp.ClientSession) -> None:
    first = await prefill(http, nixl, "stream it")
    body = chat("stream it", 4, stream=True, kv_transfer_params=first["kv_transfer_params"])
    async with http.post(nixl.urls[1] + "/v1/chat/completions", json=body) as resp:
        lines = [line async for line in resp.content if line.startswith(b"data: {")]
    chunks = [json.loads(line[6:]) for line in lines]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text.split() == ["lorem", "ipsum", "dolor", "sit"] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_expired_blocks_are_read_anyway_as_nixl_does(http: aiohttp.ClientSession) -> None:
    """vLLM's decode side cannot tell that the prefill side's lease ran out: its one-sided read succeeds (on blocks
    that may hold anything by then), and the prefill side counts the late notification."""
    fleet = await fleet_of(2, mode="nixl", lease_s=0.1)
    try:
        p, d = fleet.servers
        first = await prefill(http, fleet, "too late")
        await wait_for(lambda: p.kv_transfer.stats.kv_expired_reqs == 1)
        assert p.model.kv_usage == 0
        stale = {**first["kv_transfer_params"], "remote_request_id": "chatcmpl-unknown"}
        for params in (first["kv_transfer_params"], stale):
            status, answer = await post(http, d.url, chat("too late", 2, kv_transfer_params=params))
            assert status == 200 and answer["usage"]["completion_tokens"] == 2
        at_p = await metrics(http, p.url)
        assert total(at_p, "vllm:nixl_num_kv_expired_reqs_total") == 1
        assert total(at_p, "vllm:nixl_num_notifications_after_expiry_total") == 2
    finally:
        await fleet.close()


async def test_a_waiting_decode_leg_keeps_the_lease_alive(http: aiohttp.ClientSession) -> None:
    """The decode instance is busy (one running slot) for longer than the lease: its heartbeats renew it."""
    config = EngineConfig.from_profile("8b", kv_capacity_tokens=64_000, max_running=1)
    fleet = await start_fleet(2, config=config, time_scale=SCALE, kv_transfer=TransferConfig("nixl", lease_s=0.3))
    try:
        p, d = fleet.servers
        first = await prefill(http, fleet, "wait your turn")
        busy = asyncio.create_task(post(http, d.url, chat("long", 3000)))  # 3000 steps of 12 ms: 0.72 s at 1/50
        await wait_for(lambda: d.model.num_running == 1)
        start = time.perf_counter()
        status, _ = await post(http, d.url, chat("wait your turn", 2, kv_transfer_params=first["kv_transfer_params"]))
        assert status == 200 and (await busy)[0] == 200
        assert time.perf_counter() - start > 0.3  # it waited longer than the lease
        assert p.kv_transfer.stats.kv_expired_reqs == 0 and p.kv_transfer.stats.notifications_after_expiry == 0
    finally:
        await fleet.close()


async def test_a_decode_leg_given_up_frees_the_remote_blocks(http: aiohttp.ClientSession) -> None:
    """A client that leaves while its decode leg waits for a slot: the decode side tells the prefill side, which
    frees the blocks at once rather than at the end of their lease (as vLLM's decode side does for an abort)."""
    config = EngineConfig.from_profile("8b", kv_capacity_tokens=64_000, max_running=1)
    fleet = await start_fleet(2, config=config, time_scale=SCALE, kv_transfer=TransferConfig("nixl"))
    try:
        p, d = fleet.servers
        first = await prefill(http, fleet, "never mind")
        busy = asyncio.create_task(post(http, d.url, chat("long", 3000)))
        await wait_for(lambda: d.model.num_running == 1)
        leg = asyncio.create_task(post(http, d.url, chat("never mind", 2,
                                                         kv_transfer_params=first["kv_transfer_params"])))
        await wait_for(lambda: d.model.num_waiting == 1)
        leg.cancel()
        await wait_for(lambda: p.model.kv_usage == 0, timeout=2.0)
        assert d.model.num_waiting == 0 and p.kv_transfer.stats.kv_expired_reqs == 0
        busy.cancel()
    finally:
        await fleet.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_an_unreachable_prefill_instance(policy: str, http: aiohttp.ClientSession) -> None:
    """vLLM's kv_load_failure_policy: "fail" (its default) ends the request with a 500; "recompute" computes the
    prompt locally."""
    fleet = await fleet_of(2, mode="nixl", failure_policy=policy)
    try:
        p, d = fleet.servers
        first = await prefill(http, fleet, "gone")
        params = first["kv_transfer_params"]
        for broken in ({**params, "remote_port": 1}, {**params, "remote_engine_id": "another-engine"}):
            status, answer = await post(http, d.url, chat("gone", 3, kv_transfer_params=broken))
            if policy == "fail":
                assert status == 500 and answer["error"]["type"] == "InternalServerError", answer
            else:
                assert status == 200 and answer["usage"]["completion_tokens"] == 3
        at_d = await metrics(http, d.url)
        assert total(at_d, "vllm:nixl_num_failed_transfers_total") == 2
        failed = at_d['vllm:request_success_total{finished_reason="error",model_name="warmroute-emulated"}']
        assert failed == (2 if policy == "fail" else 0)
        assert by_source(at_d, "local_compute") == 0  # counted as vLLM counts it: at admission, as a transfer
        assert d.model.idle and d.model.kv_usage == 0
    finally:
        await fleet.close()


async def test_bootstrap_legs_sent_together(http: aiohttp.ClientSession) -> None:
    """SGLang: the same body, with the prefill instance's bootstrap address and a room, to both instances at once."""
    p_fleet = await fleet_of(mode="bootstrap", role="prefill")
    d_fleet = await fleet_of(mode="bootstrap", role="decode", bootstrap_timeout_s=0.3)
    try:
        p, d = p_fleet.servers[0], d_fleet.servers[0]
        async with http.get(p.url + "/get_server_info") as resp:
            info = await resp.json()
        assert info["disaggregation_mode"] == "prefill"
        for stream in (False, True):
            room = random.randrange(2 ** 63)
            body = chat(f"room {room}", 5, stream=stream, bootstrap_host="127.0.0.1",
                        bootstrap_port=info["disaggregation_bootstrap_port"], bootstrap_room=room)
            if stream:
                body["stream_options"] = {"include_usage": True}
            (p_status, p_answer), (d_status, d_answer) = await asyncio.gather(
                read(http, p.url, body), read(http, d.url, body))
            assert (p_status, d_status) == (200, 200)
            assert p_answer.split() == ["lorem"] and d_answer.split() == ["lorem", "ipsum", "dolor", "sit", "amet"]
        at_d = await metrics(http, d.url)
        assert by_source(at_d, "local_compute") == 0 and by_source(at_d, "external_kv_transfer") > 1000
        assert p.model.kv_usage == 0 and d.model.kv_usage == 0

        lonely = chat("no prefill", 2, bootstrap_host="127.0.0.1", bootstrap_port=int(p.url.rsplit(":", 1)[1]),
                      bootstrap_room=1)
        status, answer = await post(http, d.url, lonely)
        assert status == 500 and answer["error"]["type"] == "InternalServerError"
        status, answer = await post(http, p.url, chat("no room", 2))
        assert status == 400 and "bootstrap_room" in answer["error"]["message"]
    finally:
        await p_fleet.close()
        await d_fleet.close()


async def read(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str]:
    """Status and generated text of a chat completion, streamed or not."""
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        if not body.get("stream"):
            reply = await resp.json()
            return resp.status, reply["choices"][0]["message"]["content"]
        text = ""
        async for line in resp.content:
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:])["choices"]
                text += choices[0]["delta"].get("content", "") if choices else ""
        return resp.status, text


def test_cli_checks_the_pd_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine", "--kv-transfer", "bootstrap"]) == 2
    assert main(["engine", "--pd-role", "decode"]) == 2
    assert main(["engine", "--kv-transfer", "nixl", "--pd-role", "prefill"]) == 2
    assert main(["engine", "--kv-transfer", "nixl", "--kv-lease-s", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("warmroute engine: error: ") for line in err)
