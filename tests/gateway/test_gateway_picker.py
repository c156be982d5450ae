"""The endpoint picker's side of the ext_proc protocol, driven message by message over a real gRPC channel (what a
gateway other than the shipped Envoy configuration may send: full-duplex bodies, subset hints, broken streams)."""

from __future__ import annotations

import asyncio
import json

import pytest

grpc = pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install 'warmroute[gateway]'")
from envoy.config.core.v3 import base_pb2 as core  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as modes  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from client_helpers import wait_for  # noqa: E402
from warmroute.gateway.endpoints import endpoint_of  # noqa: E402
from warmroute.gateway.picker import DESTINATION, SERVED, SERVICE_NAME, SUBSET  # noqa: E402
from warmroute.gateway.server import start_picker  # noqa: E402
from warmroute.router.settings_load import load_settings  # noqa: E402

Mode = modes.ProcessingMode


@pytest.fixture
async def picker(stand_ins):
    running = await start_picker(load_settings({
        "backends": [f"s{i}={e.url}" for i, e in enumerate(stand_ins)], "port": 0, "epp_port": 0, "epp_fallbacks": 1,
        "health_interval": 3600, "engine_metrics": False, "models_interval": 0}, env={}))
    yield running
    await running.stop()


@pytest.fixture
async def channel(picker):
    async with grpc.aio.insecure_channel(picker.target) as ch:
        yield ch


def _headers(path: str, method: str = "POST", eos: bool = False, **extra: str) -> ep.HttpHeaders:
    pairs = {":path": path, ":method": method, "content-type": "application/json", **extra}
    return ep.HttpHeaders(headers=core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode())
                                                          for k, v in pairs.items()]), end_of_stream=eos)


def _chat_body(text: str = "hello") -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text * 50}]}).encode()


def _set_headers(mutation: ep.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def _metadata_value(reply: ep.ProcessingResponse) -> str:
    return reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value


def _books(running) -> int:
    return sum(i.inflight for i in running.picker.router.fleet.instances.values())


class Stream:
    """One ext_proc stream, as a gateway drives it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = ep_grpc.ExternalProcessorStub(channel).Process()

    async def send(self, **message) -> None:
        await self.call.write(ep.ProcessingRequest(**message))

    async def reply(self) -> ep.ProcessingResponse:
        return await asyncio.wait_for(self.call.read(), 5)


async def test_buffered_body_gets_the_endpoint_and_a_fallback_in_header_and_metadata(picker, stand_ins, channel):
    s = Stream(channel)
    await s.send(request_headers=_headers("/v1/chat/completions"))
    assert (await s.reply()).HasField("request_headers")  # BUFFERED: the headers go on unchanged
    await s.send(request_body=ep.HttpBody(body=_chat_body(), end_of_stream=True))
    reply = await s.reply()
    value = _set_headers(reply.request_body.response.header_mutation)[DESTINATION]
    endpoints = value.split(",")
    assert len(endpoints) == 2 and len(set(endpoints)) == 2  # the choice, then one fallback (epp_fallbacks 1)
    assert set(endpoints) <= {endpoint_of(e.url) for e in stand_ins}
    assert _metadata_value(reply) == value  # never two different values
    assert _books(picker) == 1
    await s.send(response_headers=_headers("", **{":status": "200"}))
    reply = await s.reply()
    assert _set_headers(reply.response_headers.response.header_mutation)["x-warmroute-reason"] == "cold"
    await s.send(response_body=ep.HttpBody(body=b'{"usage": {}}', end_of_stream=True))
    await s.reply()
    assert _books(picker) == 0  # answered in full: closed before the stream even ends
    await s.call.done_writing()


async def test_full_duplex_body_is_decided_at_its_end_and_echoed(picker, channel):
    s = Stream(channel)
    config = ep.ProtocolConfiguration(request_body_mode=Mode.FULL_DUPLEX_STREAMED,
                                      response_body_mode=Mode.FULL_DUPLEX_STREAMED)
    body = _chat_body("chunked ")
    await s.send(request_headers=_headers("/v1/chat/completions"), protocol_config=config)
    await s.send(request_body=ep.HttpBody(body=body[:100]))
    await s.send(request_body=ep.HttpBody(body=body[100:], end_of_stream=True))
    headers = await s.reply()  # nothing was answered before the body's end
    assert DESTINATION in _set_headers(headers.request_headers.response.header_mutation)
    echoed = (await s.reply()).request_body.response.body_mutation.streamed_response
    assert (echoed.body, echoed.end_of_stream) == (body, True)
    await s.send(response_headers=_headers("", **{":status": "200"}))
    await s.reply()
    await s.send(response_body=ep.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))
    chunk = (await s.reply()).response_body.response.body_mutation.streamed_response
    assert (chunk.body, chunk.end_of_stream) == (b"data: [DONE]\n\n", True)
    await s.call.done_writing()


async def test_a_request_without_body_is_decided_on_its_headers(picker, channel):
    s = Stream(channel)
    await s.send(request_headers=_headers("/v1/models", method="GET", eos=True))
    reply = await s.reply()
    assert DESTINATION in _set_headers(reply.request_headers.response.header_mutation)
    s.call.cancel()
    await wait_for(lambda: _books(picker) == 0)


def _subset_hint(endpoints: list[str]) -> core.Metadata:
    hint = struct_pb2.Struct()
    hint.update({SUBSET: endpoints})
    return core.Metadata(filter_metadata={"envoy.lb.subset_hint": hint})


async def test_the_subset_hint_limits_the_choice(picker, stand_ins, channel):
    only = endpoint_of(stand_ins[2].url)
    for _ in range(4):
        s = Stream(channel)
        await s.send(request_headers=_headers("/v1/chat/completions"), metadata_context=_subset_hint([only]))
        await s.reply()
        await s.send(request_body=ep.HttpBody(body=_chat_body(str(_)), end_of_stream=True))
        reply = await s.reply()
        assert _set_headers(reply.request_body.response.header_mutation)[DESTINATION] == only  # no fallback outside
        s.call.cancel()
    assert all(i.healthy for i in picker.picker.router.fleet.instances.values())  # the others are back


async def test_a_subset_with_no_ready_endpoint_is_a_503(picker, channel):
    s = Stream(channel)
    await s.send(request_headers=_headers("/v1/chat/completions"), metadata_context=_subset_hint(["10.9.9.9:80"]))
    await s.reply()
    await s.send(request_body=ep.HttpBody(body=_chat_body(), end_of_stream=True))
    reply = await s.reply()
    assert reply.immediate_response.status.code == 503
    assert json.loads(reply.immediate_response.body)["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize(("body", "status", "words"), [
    (b"{not json", 400, "not valid JSON"), (b"", 400, "empty"), (b"[1]", 400, ""),
])
async def test_a_bad_body_is_serves_400(picker, channel, body, status, words):
    s = Stream(channel)
    await s.send(request_headers=_headers("/v1/chat/completions"))
    await s.reply()
    await s.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
    reply = await s.reply()
    assert reply.immediate_response.status.code == status
    assert words in json.loads(reply.immediate_response.body)["error"]["message"]
    assert _books(picker) == 0


async def test_a_body_over_the_limit_is_a_413_before_it_is_read(picker, channel):
    s = Stream(channel)
    await s.send(request_headers=_headers("/v1/chat/completions", **{"content-length": str(10**9)}))
    assert (await s.reply()).immediate_response.status.code == 413


async def test_books_close_when_the_stream_breaks_at_any_point(picker, channel):
    for stage in ("decided", "answering"):
        s = Stream(channel)
        await s.send(request_headers=_headers("/v1/chat/completions", method="POST"))
        await s.reply()
        await s.send(request_body=ep.HttpBody(body=_chat_body(stage), end_of_stream=True))
        await s.reply()
        if stage == "answering":
            await s.send(response_headers=_headers("", **{":status": "200"}))
            await s.reply()
            await s.send(response_body=ep.HttpBody(body=b"data: {}\n\n"))
            await s.reply()
        assert _books(picker) == 1
        s.call.cancel()  # the gateway reset the stream (its client left)
        await wait_for(lambda: _books(picker) == 0)
    assert picker.picker.streams == 0


async def test_repeated_and_out_of_order_messages_never_open_a_second_ticket(picker, channel):
    """#33: a client of the ext_proc service that sends a request's headers (end of stream) fifty times on one
    stream, then a body, gets one decision and a refusal, and the books return to zero: later requests are not
    held behind tickets nobody closes."""
    s = Stream(channel)
    for _ in range(50):
        await s.send(request_headers=_headers("/v1/models", method="GET", eos=True))
    first = await s.reply()
    assert DESTINATION in _set_headers(first.request_headers.response.header_mutation)
    refused = await s.reply()
    assert refused.immediate_response.status.code == 400
    assert b"after this stream's request was decided" in refused.immediate_response.body
    await s.send(request_body=ep.HttpBody(body=_chat_body(), end_of_stream=True))
    await wait_for(lambda: _books(picker) == 0)
    s.call.cancel()
    await wait_for(lambda: picker.picker.streams == 0)
    assert _books(picker) == 0 and picker.picker.router.admission.idle()
    assert await _pick(channel, "after the flood")  # the next stream is decided as usual


async def test_response_messages_out_of_order_are_refused_and_the_books_return_to_zero(picker, channel):
    """#33: a second response_headers naming another endpoint after the first byte was seen, or a response body
    after the answer ended, opens nothing: the first is refused, the other passes, and every book is at zero."""
    s = Stream(channel)
    await s.send(request_headers=_headers("/v1/chat/completions"))
    await s.reply()
    await s.send(request_body=ep.HttpBody(body=_chat_body("twice"), end_of_stream=True))
    first, fallback = _set_headers((await s.reply()).request_body.response.header_mutation)[DESTINATION].split(",")
    await s.send(response_headers=_headers("", **{":status": "200"}))
    await s.reply()
    await s.send(response_body=ep.HttpBody(body=b"data: {}\n\n"))
    await s.reply()
    assert _books(picker) == 1
    served = struct_pb2.Struct()
    served.update({SERVED: fallback})
    await s.send(response_headers=_headers("", **{":status": "200"}),
                 metadata_context=core.Metadata(filter_metadata={"envoy.lb": served}))
    refused = await s.reply()
    assert refused.immediate_response.status.code == 400 and b"response_headers" in refused.immediate_response.body
    await s.send(response_body=ep.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))
    await s.reply()
    router = picker.picker.router
    assert _books(picker) == 0 and router.fleet.instances  # nothing moved to the fallback either
    assert all((i.pending, i.inflight_prompt_tokens, i.queued_prefill_tokens) == (0, 0, 0)
               for i in router.fleet.instances.values())
    assert router.admission.idle() and not router.admission.active_tenants
    s.call.cancel()
    await wait_for(lambda: picker.picker.streams == 0)


async def test_the_books_follow_the_endpoint_that_served(picker, stand_ins, channel):
    s = Stream(channel)
    await s.send(request_headers=_headers("/v1/chat/completions"))
    await s.reply()
    await s.send(request_body=ep.HttpBody(body=_chat_body("served"), end_of_stream=True))
    first, fallback = _set_headers((await s.reply()).request_body.response.header_mutation)[DESTINATION].split(",")
    served = struct_pb2.Struct()
    served.update({SERVED: fallback})
    await s.send(response_headers=_headers("", **{":status": "200"}),
                 metadata_context=core.Metadata(filter_metadata={"envoy.lb": served}))
    reply = await s.reply()
    fleet = picker.picker.router.fleet
    names = {endpoint_of(picker.picker.urls[n]): n for n in fleet.instances}
    assert _set_headers(reply.response_headers.response.header_mutation)["x-warmroute-instance"] == names[fallback]
    assert fleet.instances[names[fallback]].inflight == 1 and fleet.instances[names[first]].inflight == 0
    assert not fleet.instances[names[first]].healthy  # it refused the connection
    s.call.cancel()
    await wait_for(lambda: _books(picker) == 0)


async def test_grpc_health_answers_liveness_readiness_and_the_service(picker, channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("liveness", "readiness", SERVICE_NAME):
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert SERVICE_NAME == "envoy.service.ext_proc.v3.ExternalProcessor"


async def _pick(channel: grpc.aio.Channel, text: str, subset: list[str] | None = None) -> str:
    s = Stream(channel)
    extra = {"metadata_context": _subset_hint(subset)} if subset else {}
    await s.send(request_headers=_headers("/v1/chat/completions"), **extra)
    await s.reply()
    await s.send(request_body=ep.HttpBody(body=_chat_body(text), end_of_stream=True))
    reply = await s.reply()
    s.call.cancel()
    if reply.HasField("immediate_response"):
        return str(reply.immediate_response.status.code)
    return _set_headers(reply.request_body.response.header_mutation)[DESTINATION]


async def test_endpoints_come_from_the_backends_file_and_the_admin_api(stand_ins, tmp_path):
    import aiohttp

    listed = tmp_path / "backends.yaml"
    listed.write_text(f"backends: [file-0={stand_ins[0].url}]\n")
    running = await start_picker(load_settings({
        "backends_file": str(listed), "backends_file_interval": 0.05, "admin_token": "t" * 32, "port": 0,
        "epp_port": 0, "health_interval": 3600, "engine_metrics": False, "models_interval": 0}, env={}))
    try:
        async with grpc.aio.insecure_channel(running.target) as ch:
            assert await _pick(ch, "a") == endpoint_of(stand_ins[0].url)
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer " + "t" * 32}) as client:
                async with client.post(running.url + "/admin/instances",
                                       json={"name": "admin-1", "url": stand_ins[1].url}) as r:
                    assert r.status == 201, await r.text()
            only_new = [endpoint_of(stand_ins[1].url)]
            assert await _pick(ch, "b", subset=only_new) == only_new[0]
            listed.write_text(f"backends: [file-2={stand_ins[2].url}]\n")  # file-0 leaves, file-2 joins
            await wait_for(lambda: set(running.picker.router.fleet.instances) == {"admin-1", "file-2"})
            await wait_for(lambda: running.picker.router.fleet.instances["file-2"].healthy)
            picked = {await _pick(ch, str(i)) for i in range(8)}
            assert picked <= {endpoint_of(stand_ins[1].url), endpoint_of(stand_ins[2].url)}
    finally:
        await running.stop()


@pytest.mark.parametrize(("argv", "words"), [
    (["--backend", "http://localhost:8000"], "host name"),
    (["--backend", "http://127.0.0.1:8000", "--workers", "2"], "one process"),
    (["--backend", "http://127.0.0.1:8000", "--epp-fallbacks", "99"], "epp_fallbacks"),
])
def test_what_the_picker_cannot_do_is_one_line_and_exit_2(argv, words, capsys):
    from warmroute.cli import main

    assert main(["epp", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and err.startswith("warmroute epp: error:")


async def _decided(channel: grpc.aio.Channel, text: str) -> tuple[str, str]:
    """(endpoint, reason) of one request, up to its response headers; then the stream ends."""
    s = Stream(channel)
    await s.send(request_headers=_headers("/v1/chat/completions"))
    await s.reply()
    await s.send(request_body=ep.HttpBody(body=_chat_body(text), end_of_stream=True))
    endpoint = _set_headers((await s.reply()).request_body.response.header_mutation)[DESTINATION]
    await s.send(response_headers=_headers("", **{":status": "200"}))
    reason = _set_headers((await s.reply()).response_headers.response.header_mutation)["x-warmroute-reason"]
    await s.send(response_body=ep.HttpBody(body=b"{}", end_of_stream=True))
    await s.reply()
    await s.call.done_writing()
    return endpoint.split(",")[0], reason


async def test_picker_replicas_share_their_index_through_redis(stand_ins, redis_url):  # noqa: F811
    values = {"backends": [f"s{i}={e.url}" for i, e in enumerate(stand_ins)], "port": 0, "epp_port": 0,
              "health_interval": 3600, "engine_metrics": False, "models_interval": 0, "redis_url": redis_url}
    a, b = [await start_picker(load_settings(values, env={})) for _ in range(2)]
    try:
        async with grpc.aio.insecure_channel(a.target) as ch_a, grpc.aio.insecure_channel(b.target) as ch_b:
            endpoint, reason = await _decided(ch_a, "shared")
            assert reason == "cold"
            await wait_for(lambda: b.picker.router.shared.received > 0)
            assert await _decided(ch_b, "shared") == (endpoint, "cache_hit")  # b knows where a put it
    finally:
        await a.stop()
        await b.stop()


async def test_a_body_larger_than_grpcs_default_message_limit_is_read(picker, channel):
    s = Stream(channel)  # grpc's default limit is 4 MiB a message; max_body_bytes is 32 MiB
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (6 << 20)}]}).encode()
    await s.send(request_headers=_headers("/v1/chat/completions"))
    await s.reply()
    await s.send(request_body=ep.HttpBody(body=body, end_of_stream=True))
    assert DESTINATION in _set_headers((await s.reply()).request_body.response.header_mutation)
    s.call.cancel()


@pytest.mark.parametrize(("path", "extra", "status"), [
    ("/reset_prefix_cache", {}, 404), ("/v1/chat/completions", {"content-encoding": "gzip"}, 415)])
async def test_what_serve_would_not_forward_is_refused(picker, channel, path, extra, status):
    s = Stream(channel)
    await s.send(request_headers=_headers(path, **extra))
    reply = await s.reply()
    assert reply.immediate_response.status.code == status
    assert json.loads(reply.immediate_response.body)["error"]["code"] == status


async def test_the_picker_dispatches_with_the_routing_key_and_the_tenant_as_serve_does(picker, channel,
                                                                                         monkeypatch):
    """#33: the gateway's requests carry what serve's do into the books: the routing key (precise mode holds the
    prompt's token blocks at the chosen instance from it) and the tenant (by API key), admission on or off."""
    router = picker.picker.router
    seen: list[tuple[object, str]] = []
    dispatch = router.dispatch

    def spy(life, decision, defer_record=False):
        seen.append((life.key, life.tenant))
        return dispatch(life, decision, defer_record)

    monkeypatch.setattr(router, "dispatch", spy)
    for enabled in (True, False):
        monkeypatch.setattr(router.admission.settings, "enabled", enabled)
        s = Stream(channel)
        await s.send(request_headers=_headers("/v1/chat/completions", authorization="Bearer sk-team-a"))
        await s.reply()
        await s.send(request_body=ep.HttpBody(body=_chat_body("keyed"), end_of_stream=True))
        await s.reply()
        s.call.cancel()
    await wait_for(lambda: _books(picker) == 0)
    tenant = picker.picker.tenancy.key_tenant("sk-team-a")
    assert len(seen) == 2 and tenant.startswith("key-")
    for key, who in seen:
        assert key is not None and key.model == "m" and who == tenant
