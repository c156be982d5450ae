"""What a careful reading found (issue #22): compressed bodies, paths outside the inference API, control
operations, the Anthropic route, slow uploads, content types and what the OpenAI API rejects, each checked
against what reached the instance."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import aiohttp
import pytest
from aiohttp import web

from fake_upstream import CHAT, Upstream, router_for
from warmroute.core.routing_key import KeyError_, key_for_json
from warmroute.router.app import ROUTER

TOKEN = "admin-secret"


@pytest.fixture
async def client():
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        yield s


def _forwarded(up: Upstream) -> list[tuple[str, str, dict, bytes]]:
    return [s for s in up.seen if s[1] != "/v1/models"]


# -- 1: compressed bodies -----------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_compressed_bodies_reach_the_engine_decompressed_and_unlabelled(up_a, client, encoding, compress):
    router = await router_for(up_a)
    try:
        raw = json.dumps(CHAT).encode()
        async with client.post(router.url + "/v1/chat/completions", data=compress(raw),
                               headers={"Content-Encoding": encoding, "Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
        _, _, headers, body = up_a.seen[-1]
        assert body == raw
        assert "content-encoding" not in {k.lower() for k in headers}
        assert headers["Content-Length"] == str(len(raw))
    finally:
        await router.stop()


@pytest.mark.parametrize("encoding", ["compress", "gzip, gzip", "x-custom"])
async def test_an_unsupported_encoding_is_a_415(up_a, client, encoding):
    router = await router_for(up_a)
    try:
        async with client.post(router.url + "/v1/chat/completions", data=gzip.compress(json.dumps(CHAT).encode()),
                               headers={"Content-Encoding": encoding, "Content-Type": "application/json"}) as r:
            assert r.status == 415
            assert "Content-Encoding" in (await r.json())["error"]["message"]
        assert _forwarded(up_a) == []
    finally:
        await router.stop()


async def test_a_corrupt_gzip_body_is_a_400(up_a, client):
    router = await router_for(up_a)
    try:
        async with client.post(router.url + "/v1/chat/completions", data=b"\x1f\x8b\x08\x00garbage" * 10,
                               headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
            assert r.status == 400, await r.text()
        assert _forwarded(up_a) == []
    finally:
        await router.stop()


async def test_a_gzip_bomb_is_bounded_by_max_body_bytes(up_a, client):
    router = await router_for(up_a, max_body_bytes="64KiB")
    try:
        bomb = gzip.compress(b'{"model":"m","messages":[{"role":"user","content":"' + b"a" * 10_000_000 + b'"}]}')
        assert len(bomb) < 64 * 1024
        async with client.post(router.url + "/v1/chat/completions", data=bomb,
                               headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
            assert r.status == 413
        assert _forwarded(up_a) == []
    finally:
        await router.stop()


# -- 2: only the inference API is forwarded; control operations through the admin API ------------------------
@pytest.mark.parametrize("path", ["/reset_prefix_cache", "/sleep", "/wake_up", "/start_profile",
                                  "/collective_rpc", "/pause", "/v1/unknown/thing", "//evil.example/steal"])
async def test_paths_outside_the_inference_api_are_404_and_never_forwarded(up_a, client, path):
    router = await router_for(up_a)
    try:
        for method in ("GET", "POST"):
            async with client.request(method, router.url + path, data=b"{}") as r:
                assert r.status == 404
                assert (await r.json())["error"]["type"] == "not_found_error"
        assert _forwarded(up_a) == []
    finally:
        await router.stop()


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/score", "/v1/rerank", "/pooling"])
async def test_the_rest_of_the_inference_api_is_forwarded(up_a, client, path):
    router = await router_for(up_a)
    try:
        async with client.post(router.url + path + "?q=1", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 200
            assert r.headers["x-warmroute-reason"] == "load_balance"
        assert up_a.seen[-1][:2] == ("POST", path + "?q=1")
    finally:
        await router.stop()


async def test_reset_prefix_cache_fans_out_and_clears_the_index(up_a, up_b, client):
    router = await router_for(up_a, up_b, admin_token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        fleet = router.app[ROUTER].fleet
        big = {"model": "m", "messages": [{"role": "user", "content": "a long shared document " * 200}]}
        async with client.post(router.url + "/v1/chat/completions", json=big) as r:
            assert r.status == 200
            held_by = r.headers["x-warmroute-instance"]
        await asyncio.sleep(0)
        assert fleet.index.entries(held_by) > 0

        async with client.post(router.url + "/admin/reset_prefix_cache") as r:
            assert r.status == 401  # the token guards it
        async with client.post(router.url + "/admin/reset_prefix_cache", headers=auth) as r:
            assert r.status == 200
            answer = await r.json()
        assert answer["reset"] is True and set(answer["instances"]) == {"a", "b"}
        for up in (up_a, up_b):
            assert up.seen[-1][:2] == ("POST", "/reset_prefix_cache")
        assert fleet.index.entries(held_by) == 0

        async def refuse(request: web.Request) -> web.Response:
            return web.Response(status=404)

        async with client.post(router.url + "/v1/chat/completions", json=big) as r:
            held_by = r.headers["x-warmroute-instance"]
        await asyncio.sleep(0)
        (up_a if held_by == "a" else up_b).behaviour = refuse  # an engine without dev mode: nothing was reset
        async with client.post(router.url + f"/admin/reset_prefix_cache?instance={held_by}", headers=auth) as r:
            assert r.status == 502
            assert (await r.json())["instances"][held_by] == {"status": 404, "reset": False}
        assert fleet.index.entries(held_by) > 0  # it still holds what it held
        async with client.post(router.url + "/admin/reset_prefix_cache?instance=nope", headers=auth) as r:
            assert r.status == 404
    finally:
        await router.stop()


# -- 3: the Anthropic Messages API ------------------------------------------------------------------------------
ANTHROPIC = {"model": "m", "max_tokens": 16, "system": "You are a coding agent. " * 40,
             "tools": [{"name": "read_file", "description": "Read a file",
                        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
             "messages": [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]}


def test_anthropic_messages_key_like_the_same_chat_request():
    anthropic = key_for_json("/v1/messages", ANTHROPIC)
    chat = key_for_json("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "system", "content": ANTHROPIC["system"]},
                                   {"role": "user", "content": "fix the bug"}],
        "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                    "parameters": ANTHROPIC["tools"][0]["input_schema"]}}]})
    assert anthropic.data == chat.data and anthropic.blocks() == chat.blocks()
    data = anthropic.data
    assert data.index(b"read_file") < data.index(b"coding agent") < data.index(b"fix the bug")  # template order
    other_system = key_for_json("/v1/messages", {**ANTHROPIC, "system": "Another agent. " * 40})
    assert other_system.blocks()[0] == anthropic.blocks()[0]  # the tools come first, shared
    assert other_system.blocks()[-1] != anthropic.blocks()[-1]
    with pytest.raises(KeyError_, match="messages"):
        key_for_json("/v1/messages", {**ANTHROPIC, "messages": []})


async def test_anthropic_messages_are_routed_by_prefix(up_a, up_b, client):
    router = await router_for(up_a, up_b)
    try:
        instances = set()
        for i in range(6):
            body = {**ANTHROPIC, "messages": [{"role": "user", "content": f"question {i}"}]}
            async with client.post(router.url + "/v1/messages", json=body) as r:
                assert r.status == 200
                instances.add(r.headers["x-warmroute-instance"])
                reason = r.headers["x-warmroute-reason"]
        assert len(instances) == 1 and reason == "cache_hit"  # one shared prefix, one warm instance
    finally:
        await router.stop()


# -- 5: idle timeout on uploads is a gap, not a deadline -------------------------------------------------------
async def test_a_slow_but_steady_upload_is_not_cut_off(up_a):
    router = await router_for(up_a, idle_timeout=0.4)
    try:
        raw = json.dumps(CHAT).encode()
        pieces = [raw[i:i + len(raw) // 8 + 1] for i in range(0, len(raw), len(raw) // 8 + 1)]
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(raw))
        for piece in pieces:  # about 1.5 s in all, never 0.4 s without a byte
            await asyncio.sleep(0.15)
            writer.write(piece)
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert up_a.seen[-1][3] == raw
    finally:
        await router.stop()


# -- 6: content types ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type,status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data; boundary=x", 415),
    ("application/json; charset=utf-8", 200), ("application/vnd.api+json", 200), (None, 200)])
async def test_json_routes_take_only_json(up_a, client, content_type, status):
    router = await router_for(up_a)
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        async with client.post(router.url + "/v1/chat/completions", data=json.dumps(CHAT).encode(),
                               headers=headers, skip_auto_headers=["Content-Type"]) as r:
            assert r.status == status, await r.text()
        assert len(_forwarded(up_a)) == (status == 200)
    finally:
        await router.stop()


# -- 7: what the OpenAI API rejects is never forwarded -----------------------------------------------------------
@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": 5, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/completions", {"model": ["m"], "prompt": "hi"}, "model"),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
])
async def test_invalid_requests_are_a_json_400_naming_the_field(up_a, client, path, body, field):
    router = await router_for(up_a)
    try:
        async with client.post(router.url + path, json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert field in error["message"] and error["type"] == "invalid_request_error"
        assert _forwarded(up_a) == []  # nothing reached the engine
    finally:
        await router.stop()


async def test_an_assistant_tool_call_may_have_no_content(up_a, client):
    router = await router_for(up_a)
    try:
        body = {"model": "m", "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                   "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "sunny"}]}
        async with client.post(router.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
        assert len(_forwarded(up_a)) == 1
    finally:
        await router.stop()


# -- 8: image parts --------------------------------------------------------------------------------------------------
def test_images_sharing_an_encoder_header_key_apart():
    header = "data:image/png;base64," + "iVBORw0KGgoAAAANSUhEUgAA" * 20  # the same first 500 characters

    def key(tail: str):
        part = {"type": "image_url", "image_url": {"url": header + tail}}
        return key_for_json("/v1/chat/completions", {"model": "m", "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "describe"}]}]})

    assert key("AAAA").data != key("BBBB").data
    assert key("AAAA").data == key("AAAA").data
    assert len(key("A" * 100_000).data) < 200  # a digest, not the image


async def test_a_large_body_is_keyed_off_the_loop_and_routed_alike(up_a, up_b, client):
    """A body past OFF_LOOP_BYTES gets its key built in a thread (benchmarks/body_parse.py measures the stall);
    it is routed exactly as in the loop: the same prompt again is a cache hit on the same instance."""
    from warmroute.router.routing import OFF_LOOP_BYTES

    router = await router_for(up_a, up_b)
    try:
        big = {"model": "m", "messages": [{"role": "user", "content": "a long document. " * (OFF_LOOP_BYTES // 16)}]}
        seen = []
        for _ in range(2):
            async with client.post(router.url + "/v1/chat/completions", json=big) as r:
                assert r.status == 200
                seen.append((r.headers["x-warmroute-instance"], r.headers["x-warmroute-reason"]))
        assert seen[0][0] == seen[1][0] and seen[1][1] == "cache_hit"
        async with client.post(router.url + "/v1/chat/completions", json={**big, "model": 5}) as r:
            assert r.status == 400 and "model" in (await r.json())["error"]["message"]  # checked in the thread
    finally:
        await router.stop()


# -- 4: a retry after a first-byte timeout closes the first connection first, and is a setting ----------------------
async def test_a_retry_after_no_answer_closes_the_first_request_first(up_a, up_b, client):
    events: list[str] = []

    async def hang(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            events.append("a aborted")  # what vLLM does when its client disconnects
            raise
        return web.Response(text="late")

    async def answer(request: web.Request) -> web.Response:
        await asyncio.sleep(0.05)  # a's disconnect is seen by now if it was sent before this request
        events.append("b answered")
        return web.json_response({"upstream": "b"})

    up_a.behaviour, up_b.behaviour = hang, answer
    router = await router_for(up_a, up_b, first_byte_timeout=0.3)
    router.app[ROUTER].fleet.instances["b"].inflight = 3  # so that the first choice is a
    try:
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200 and r.headers["x-warmroute-instance"] == "b"
        assert events == ["a aborted", "b answered"]
        text = await (await client.get(router.url + "/metrics")).text()
        assert 'warmroute_upstream_errors_total{backend="a",kind="timeout"} 1.0' in text
        assert 'warmroute_retries_total{backend="a",kind="upstream_timeout"} 1.0' in text
    finally:
        await router.stop()


@pytest.mark.parametrize("retry,status", [("connect", 504), ("off", 504)])
async def test_retry_policy_connect_or_off_never_sends_twice_after_a_timeout(up_a, up_b, client, retry, status):
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(text="late")

    up_a.behaviour = up_b.behaviour = hang
    router = await router_for(up_a, up_b, first_byte_timeout=0.2, retry=retry)
    try:
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == status
        assert len(_forwarded(up_a)) + len(_forwarded(up_b)) == 1
    finally:
        await router.stop()


async def test_retry_off_does_not_retry_a_refused_connection(up_a, up_b, client):
    router = await router_for(up_a, up_b, strategy="round_robin", retry="off")
    try:
        await up_a.stop()
        statuses = []
        for _ in range(2):
            async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                statuses.append(r.status)
        assert 502 in statuses and len(_forwarded(up_b)) <= 1
    finally:
        await router.stop()


# -- 9: backend names ---------------------------------------------------------------------------------------------
def test_backend_names_come_from_the_url_and_stay_put(tmp_path):
    from warmroute.router.discovery import read_backends_file
    from warmroute.router.settings import name_from_url
    from warmroute.router.settings_load import load_settings

    assert name_from_url("http://10.0.0.5:8000") == "10.0.0.5-8000"
    assert name_from_url("https://gpu-3.internal/v1/") == "gpu-3.internal-v1"
    assert name_from_url("http://[::1]:7") == "1-7"
    assert len(name_from_url("http://" + "h" * 60 + ".example:1/" + "p" * 80)) <= 63
    f = tmp_path / "backends.yaml"
    f.write_text("- http://10.0.0.1:8000\n- http://10.0.0.2:8000\n- http://10.0.0.3:8000\n")
    before = {b.name: b.url for b in read_backends_file(f)}
    f.write_text("- http://10.0.0.1:8000\n- http://10.0.0.3:8000\n")  # one line deleted
    after = {b.name: b.url for b in read_backends_file(f)}
    assert all(before[name] == url for name, url in after.items())  # nobody renamed onto another host
    s = load_settings({"backends": ["http://10.0.0.1:8000"]}, env={})
    with pytest.raises(ValueError, match="10.0.0.1-8000"):  # the same instance on the command line and in the file
        read_backends_file(f, s.backends)


def test_duplicate_backends_are_a_clear_error(tmp_path):
    from warmroute.errors import UsageError
    from warmroute.router.discovery import check_backends_file
    from warmroute.router.settings_load import load_settings

    with pytest.raises(UsageError, match="repeated: 10.0.0.1-8000"):
        load_settings({"backends": ["http://10.0.0.1:8000", "http://10.0.0.1:8000"]}, env={})
    f = tmp_path / "backends.yaml"
    f.write_text("- gpu=http://10.0.0.9:8000\n")
    s = load_settings({"backends": ["gpu=http://10.0.0.1:8000"], "backends_file": str(f)}, env={})
    with pytest.raises(UsageError, match="repeated: gpu"):
        check_backends_file(s)


async def test_a_backends_file_clashing_with_a_static_name_is_refused_whole(up_a, up_b, tmp_path, client):
    f = tmp_path / "backends.yaml"
    f.write_text(f"- b={up_b.url}\n")
    router = await router_for(up_a, backends=[f"a={up_a.url}"], backends_file=str(f), backends_file_interval=0.05)
    try:
        assert set(router.app[ROUTER].fleet.instances) == {"a", "b"}
        f.write_text(f"- a={up_b.url}\n- c={up_b.url}\n")  # 'a' is static: the file is refused, not half-applied
        await asyncio.sleep(0.4)
        assert set(router.app[ROUTER].fleet.instances) == {"a", "b"}
    finally:
        await router.stop()


# -- 10: a missing optional package is a one-line error before the port is bound -------------------------------------
@pytest.mark.parametrize("setting,value,extra", [("redis_url", "redis://127.0.0.1:1", "redis"),
                                                 ("kubernetes_service", "default/vllm", "kubernetes")])
def test_a_missing_optional_package_is_one_line_and_exit_2(monkeypatch, capsys, setting, value, extra):
    import importlib.util

    from warmroute.cli import main
    from warmroute.router import server

    monkeypatch.setattr(server, "serve", lambda settings: 99)  # got past validation: fail fast, never listen
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("redis", "kubernetes_asyncio") else real(name, *a))
    flag = "--" + setting.replace("_", "-")
    assert main(["serve", "--backend", "http://127.0.0.1:9", flag, value, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"pip install 'warmroute[{extra}]'" in err and setting in err


# -- 12: models_interval 0 means the model lists never narrow routing ------------------------------------------------
async def test_models_listing_does_not_narrow_routing_when_models_interval_is_0(up_a, up_b, client):
    up_a.models, up_b.models = ["m"], ["other"]
    router = await router_for(up_a, up_b, models_interval=0)
    try:
        async with client.get(router.url + "/v1/models") as r:
            assert {m["id"] for m in (await r.json())["data"]} == {"m", "other"}
        assert all(i.models is None for i in router.app[ROUTER].fleet.instances.values())
    finally:
        await router.stop()
