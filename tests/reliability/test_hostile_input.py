"""Hostile input against a real `warmroute serve` process: oversized and compressed bodies, wrong content types,
paths outside the inference API, the engines' control endpoints, and header injection through the names the
router uses for backends. Each case checks the answer AND what reached the instance behind the router (a
recording stand-in). docs/reliability.md lists the cases and their outcomes (run with -s to print them).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from fake_upstream import Upstream
from warmroute.bench.processes import Child

TOKEN = "hostile-suite-token"
MAX_BODY = 256 * 1024
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
CONTROL = ("/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping", "/start_profile", "/stop_profile",
           "/collective_rpc", "/pause", "/resume", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
           "/server_info", "/scale_elastic_ep", "/update_weights")


@contextlib.asynccontextmanager
async def serve(backends_file: Path) -> AsyncIterator[tuple[Upstream, str]]:
    """A router process reading `backends_file`, in front of one stand-in instance that records what reaches it."""
    engine = await Upstream("engine", models=None).start()
    backends_file.write_text(f"- engine={engine.url}\n")
    router = Child("router", [
        "serve", "--backends-file", str(backends_file), "--port", "0",
        "--admin-token", TOKEN, "--max-body-bytes", str(MAX_BODY), "--idle-timeout", "0.5",
        "--models-interval", "0", "--no-engine-metrics", "--health-interval", "3600",
        "--backends-file-interval", "0.1"], backends_file.parent)
    try:
        url = await router.wait_for_url(timeout_s=30)
        await router.wait_for_http(url + "/health", timeout_s=10)  # the backends file is read after the port is bound
        yield engine, url
    finally:
        router.stop(grace_s=0)
        await engine.stop()


async def raw(router: str, data: bytes, timeout: float = 5.0) -> bytes:
    host, port = router.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.") else 0


OUTCOMES: list[tuple[str, str]] = []


def outcome(case: str, what: str) -> None:
    OUTCOMES.append((case, what))
    print(f"  {case}: {what}")


async def test_hostile_input_against_a_router_process(tmp_path):
    async with serve(tmp_path / "backends.yaml") as (engine, router):
        # A fresh connection per request: the router closes one whose body it refused without reading it.
        async with aiohttp.ClientSession(auto_decompress=False, connector=aiohttp.TCPConnector(force_close=True)) \
                as client:

            async def post(path: str, data: bytes, headers: dict[str, str]) -> tuple[int, dict]:
                async with client.post(router + path, data=data, headers=headers,
                                       skip_auto_headers=["Content-Type"]) as r:
                    body = await r.read()
                    return r.status, (json.loads(body) if body.startswith(b"{") else {})

            JSON = {"Content-Type": "application/json"}
            chat = json.dumps(CHAT).encode()

            # -- oversized ------------------------------------------------------------------------------------
            before = len(engine.seen)
            big = json.dumps({"model": "m", "prompt": "x" * (MAX_BODY * 2)}).encode()
            status, body = await post("/v1/completions", big, JSON)
            assert status == 413 and "max_body_bytes" in body["error"]["message"]
            outcome("body of 2x max_body_bytes with Content-Length", f"{status}, refused before reading")

            async def chunks():
                for _ in range(64):
                    yield b"x" * 16384  # 1 MiB, chunked: no Content-Length to refuse on
            async with client.post(router + "/v1/completions", data=chunks(), headers=JSON) as r:
                assert r.status == 413
            outcome("1 MiB chunked body (no Content-Length)", "413")

            bomb = gzip.compress(b'{"model":"m","prompt":"' + b"a" * 50_000_000 + b'"}')
            status, _ = await post("/v1/completions", bomb, {**JSON, "Content-Encoding": "gzip"})
            assert status == 413 and len(bomb) < MAX_BODY
            outcome(f"gzip bomb ({len(bomb) // 1024} KiB to 50 MB)", f"{status}, decompression stops at the limit")
            assert len(engine.seen) == before, "nothing oversized reached the engine"

            # -- compressed -----------------------------------------------------------------------------------
            status, _ = await post("/v1/chat/completions", gzip.compress(chat), {**JSON, "Content-Encoding": "gzip"})
            _, _, headers, got = engine.seen[-1]
            assert status == 200 and got == chat and "Content-Encoding" not in headers
            outcome("gzip-compressed chat request", "200; the engine got the plain JSON, no Content-Encoding")
            for enc in ("compress", "x-evil", "gzip, gzip"):
                status, body = await post("/v1/chat/completions", gzip.compress(chat),
                                          {**JSON, "Content-Encoding": enc})
                assert status == 415 and "Content-Encoding" in body["error"]["message"]
            outcome("Content-Encoding compress / x-evil / 'gzip, gzip'", "415 each")
            status, _ = await post("/v1/chat/completions", b"\x1f\x8b\x08\x00" + b"\xff" * 64,
                                   {**JSON, "Content-Encoding": "gzip"})
            assert status == 400
            outcome("corrupt gzip body", "400")

            # -- wrong content type ---------------------------------------------------------------------------
            before = len(engine.seen)
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "application/octet-stream",
                          "multipart/form-data; boundary=z", "application/xml"):
                status, _ = await post("/v1/chat/completions", chat, {"Content-Type": ctype})
                assert status == 415, ctype
            assert len(engine.seen) == before
            outcome("chat request as text/plain, form, octet-stream, multipart, xml", "415 each, none forwarded")
            status, _ = await post("/invocations", b"\x00\x01raw", {"Content-Type": "application/octet-stream"})
            assert status == 200
            outcome("/invocations with application/octet-stream (a raw route)", "200, forwarded as is")

            # -- invalid requests the OpenAI API rejects ------------------------------------------------------
            before = len(engine.seen)
            for bad in ({"model": "m", "messages": []}, {"model": "m", "messages": [{"role": "user"}]},
                        {"model": {"$ne": 1}, "messages": CHAT["messages"]}):
                status, body = await post("/v1/chat/completions", json.dumps(bad).encode(), JSON)
                assert status == 400 and body["error"]["type"] == "invalid_request_error"
            assert len(engine.seen) == before
            outcome("empty messages, a message without content, an object as model", "400 each, none forwarded")

            # -- unknown paths and the engines' control endpoints ---------------------------------------------
            before = len(engine.seen)
            for path in CONTROL + ("/v1/unknown", "/metrics/../reset_prefix_cache", "/admin/../sleep"):
                for method in ("GET", "POST", "PUT", "DELETE"):
                    async with client.request(method, router + path, data=b"{}", headers=JSON) as r:
                        assert r.status in (404, 405), (method, path, r.status)
            for target in (b"/%2e%2e/reset_prefix_cache", b"//reset_prefix_cache", b"/./sleep",
                           b"/v1/chat/completions/../../sleep", b"http://evil.example/sleep",
                           b"/reset_prefix_cache?x=/v1/chat/completions", b"/v1/chat/completions%2f..%2f..%2fsleep"):
                answer = await raw(router, b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                           b"Connection: close\r\n\r\n{}")
                assert status_of(answer) in (400, 404), (target, answer[:100])
            assert engine.seen[before:] == [], engine.paths()[before:]
            outcome(f"{len(CONTROL)} engine control endpoints and 10 disguised paths, 4 methods each",
                    "404 (or 400 from the HTTP parser); none reached the engine")

            # -- control endpoints through the admin API ------------------------------------------------------
            async with client.post(router + "/admin/reset_prefix_cache") as r:
                assert r.status == 401
            async with client.post(router + "/admin/reset_prefix_cache",
                                   headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
            assert "/reset_prefix_cache" not in engine.paths()
            async with client.post(router + "/admin/reset_prefix_cache",
                                   headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200 and (await r.json())["instances"]["engine"]["reset"] is True
            assert engine.paths()[-1] == "/reset_prefix_cache"
            outcome("POST /admin/reset_prefix_cache without / with a wrong / with the token",
                    "401, 401, 200 (the engine's /reset_prefix_cache called once, by the router)")

            # -- header injection through the names used for backends -----------------------------------------
            admin = {"Authorization": f"Bearer {TOKEN}", **JSON}
            for name in ("x\r\nSet-Cookie: s=1", "x\nX-Evil: 1", "a b", "é", "x" * 64, "", "-lead"):
                async with client.post(router + "/admin/instances", headers=admin,
                                       json={"name": name, "url": "http://127.0.0.1:9"}) as r:
                    assert r.status == 400, name
            for url in ("http://127.0.0.1:9/\r\nHost: evil", "http://evil\r\nX: 1:9", "file:///etc/passwd",
                        "http://127.0.0.1:9/?q=1", "gopher://127.0.0.1:9"):
                async with client.post(router + "/admin/instances", headers=admin,
                                       json={"name": "n", "url": url}) as r:
                    assert r.status == 400, url
            outcome("admin-added instance named with CR/LF, space, non-ASCII, 64 chars, empty; URLs with CR/LF, "
                    "file:, gopher:, a query", "400 each")

            engine_url = f"http://127.0.0.1:{engine.runner.addresses[0][1]}"
            backends = tmp_path / "backends.yaml"
            backends.write_text(f'- "evil\\r\\nSet-Cookie: s=1={engine_url}"\n- name: "b\\nX: 1"\n  url: {engine_url}\n')
            await asyncio.sleep(0.5)  # the file is watched every 0.1 s: refused whole, the last list kept
            async with client.post(router + "/v1/chat/completions", data=chat, headers=JSON) as r:
                assert r.status == 200 and r.headers["x-warmroute-instance"] == "engine"
                assert "Set-Cookie" not in r.headers and "X" not in r.headers
            async with client.get(router + "/admin/instances", headers=admin) as r:
                assert [i["name"] for i in (await r.json())["instances"]] == ["engine"]
            outcome("backends file rewritten with names carrying CR/LF", "refused whole, the last list kept; "
                    "responses carry only the old name")

            backends.write_text(f"- http://%0d%0aevil:1/\n- {engine_url}\n")
            await asyncio.sleep(0.5)
            async with client.get(router + "/admin/instances", headers=admin) as r:
                names = [i["name"] for i in (await r.json())["instances"]]
            assert all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", n) for n in names), names
            outcome("backends file with unnamed URLs, one with an encoded CR/LF in its host",
                    f"names derived from the URLs are header-safe: {', '.join(sorted(names))}")

        # -- the router is still up and serving ---------------------------------------------------------------
        async with aiohttp.ClientSession() as client:
            async with client.post(router + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
    outcome("afterwards", "the router process still serves")


def test_a_backend_name_with_a_newline_on_the_command_line_is_one_line_and_exit_2():
    import subprocess

    run = subprocess.run([sys.executable, "-m", "warmroute", "serve", "--backend", "a\r\nX: 1=http://127.0.0.1:9",
                          "--port", "0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr
