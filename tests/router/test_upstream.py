"""The data-plane client (warmroute/router/upstream.py) against scripted HTTP servers on loopback.

Each server reads one request head (and its Content-Length body) at a time and answers with the bytes the
test gives it, so framing, keep-alive, early closes and malformed answers are exact.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from warmroute.router.upstream import ConnectError, Origin, UpstreamError, UpstreamPool

Answer = Callable[[bytes, bytes], "list[bytes | float | None]"]  # (head, body) -> writes; float = pause, None = close


class ScriptedServer:
    """Answers each request with `answer(head, body)`: bytes are written, a float sleeps, None closes."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.nth = 0  # the current request's number on its connection (1 = first)
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.base = ""

    async def __aenter__(self) -> ScriptedServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        self.close_clients()
        await asyncio.sleep(0.01)

    def close_clients(self) -> None:
        for w in self.writers:
            w.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        nth = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                nth += 1
                self.nth = nth
                for step in self.answer(head, body):
                    if step is None:
                        writer.close()
                        return
                    if isinstance(step, float):
                        await asyncio.sleep(step)
                    else:
                        writer.write(step)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()


def plain(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s" % (
        status.encode(), extra, len(body), body)


async def read_all(resp) -> bytes:  # type: ignore[no-untyped-def]
    parts = []
    while chunk := await resp.read_chunk():
        parts.append(chunk)
    return b"".join(parts)


async def test_sends_host_and_length_and_reuses_the_connection():
    async with ScriptedServer(lambda head, body: [plain(b'{"ok":' + body + b"}")]) as srv:
        pool = UpstreamPool(connect_timeout=2)
        for i in range(3):
            resp = await pool.request(srv.base, "POST", "/v1/completions?x=1",
                                      [("Authorization", "Bearer k"), ("X-Many", "a"), ("X-Many", "b")], b"%d" % i)
            assert resp.status == 200 and resp.reason == "OK"
            assert resp.headers["Content-Type"] == "application/json" and resp.content_length == 8
            assert await read_all(resp) == b'{"ok":%d}' % i
            resp.release()
        await pool.close()
    head = srv.requests[0][0].decode()
    assert head.startswith("POST /v1/completions?x=1 HTTP/1.1\r\n")
    port = srv.base.rsplit(":", 1)[1]
    assert f"\r\nHost: 127.0.0.1:{port}\r\n" in head and "\r\nContent-Length: 1\r\n" in head
    assert "Authorization: Bearer k" in head and "X-Many: a\r\nX-Many: b" in head
    assert srv.connections == 1  # keep-alive: three requests, one connection


async def test_chunked_answer_arrives_chunk_by_chunk():
    events = [b'data: {"n":%d}\n\n' % i for i in range(3)]

    def answer(head: bytes, body: bytes) -> list[bytes | float | None]:
        out: list[bytes | float | None] = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                           b"Transfer-Encoding: chunked\r\n\r\n"]
        for e in events:
            out += [b"%x\r\n%s\r\n" % (len(e), e), 0.05]
        return out + [b"0\r\n\r\n"]

    async with ScriptedServer(answer) as srv:
        pool = UpstreamPool(connect_timeout=2)
        resp = await pool.request(srv.base, "POST", "/v1/chat/completions", [], b"{}")
        got = []
        while chunk := await resp.read_chunk():
            got.append(chunk)
        assert got == events  # decoded, one chunk per write, never merged while the stream is paced
        resp.release()
        assert pool.idle_connections() == 1
        await pool.close()


async def test_answer_framed_by_close_and_head_without_body():
    async with ScriptedServer(lambda head, body: [b"HTTP/1.0 200 OK\r\n\r\nuntil the end", None]) as srv:
        pool = UpstreamPool(connect_timeout=2)
        resp = await pool.request(srv.base, "GET", "/x", [], b"")
        assert await read_all(resp) == b"until the end"
        resp.release()
        assert pool.idle_connections() == 0  # not reusable
        await pool.close()
    async with ScriptedServer(lambda head, body: [plain(b"x" * 10)[:-10]]) as srv:  # HEAD: length, no body
        pool = UpstreamPool(connect_timeout=2)
        resp = await asyncio.wait_for(pool.request(srv.base, "HEAD", "/", [], b""), 2)
        assert resp.content_length == 10 and await asyncio.wait_for(read_all(resp), 2) == b""
        resp.release()
        await pool.close()


async def test_header_values_keep_their_utf8():
    extra = "X-Name: café\r\nX-Bad: \udcff\r\n".encode("utf-8", "surrogateescape")
    async with ScriptedServer(lambda h, b: [plain(b"{}", extra=extra)]) as srv:
        pool = UpstreamPool(connect_timeout=2)
        resp = await pool.request(srv.base, "GET", "/", [], b"")
        assert resp.headers["X-Name"] == "café" and resp.headers["X-Bad"] == "\ufffd"
        await pool.close()


async def test_informational_answer_is_skipped():
    async with ScriptedServer(lambda h, b: [b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n", plain(b"{}")]) as srv:
        pool = UpstreamPool(connect_timeout=2)
        resp = await pool.request(srv.base, "POST", "/", [], b"")
        assert resp.status == 200 and "Link" not in resp.headers and await read_all(resp) == b"{}"
        assert b"Content-Length: 0" in srv.requests[0][0]  # POST without a body still says so
        await pool.close()


async def test_a_connection_closed_while_idle_is_replaced_transparently():
    async with ScriptedServer(lambda head, body: [plain(b"{}"), None]) as srv:  # answers, then closes
        pool = UpstreamPool(connect_timeout=2)
        for _ in range(3):
            resp = await pool.request(srv.base, "POST", "/", [], b"{}")
            assert await read_all(resp) == b"{}"
            resp.release()
            await asyncio.sleep(0.01)
        await pool.close()
    assert srv.connections == 3 and len(srv.requests) == 3


async def test_reused_connection_closed_before_answering_is_retried_on_a_fresh_one():
    """The race with an instance's keep-alive timeout: the request goes out on a pooled connection the
    instance is closing; nothing comes back, so it is sent again on a new connection (once)."""
    srv: ScriptedServer

    def answer(head: bytes, body: bytes) -> list[bytes | float | None]:
        return [plain(b"{}")] if srv.nth == 1 else [None]  # each connection answers once, then hangs up

    async with ScriptedServer(answer) as srv:
        pool = UpstreamPool(connect_timeout=2)
        for _ in range(2):
            resp = await pool.request(srv.base, "POST", "/", [], b"{}")
            assert resp.status == 200 and await read_all(resp) == b"{}"
            resp.release()
        await pool.close()
    assert srv.connections == 2 and len(srv.requests) == 3  # the second request went out twice


async def test_errors_are_typed():
    pool = UpstreamPool(connect_timeout=2)
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    with pytest.raises(ConnectError):
        await pool.request(f"http://127.0.0.1:{port}", "GET", "/", [], b"")

    async with ScriptedServer(lambda head, body: [b"NOT HTTP AT ALL\r\n\r\n"]) as srv2:
        with pytest.raises(UpstreamError, match="malformed"):
            await pool.request(srv2.base, "GET", "/", [], b"")
    async with ScriptedServer(lambda head, body: [None]) as srv3:
        with pytest.raises(UpstreamError, match="before answering"):
            await pool.request(srv3.base, "GET", "/", [], b"")
    async with ScriptedServer(lambda head, body: [plain(b"0123456789")[:-4], None]) as srv4:  # cut mid-body
        resp = await pool.request(srv4.base, "GET", "/", [], b"")
        with pytest.raises(UpstreamError):
            await read_all(resp)
        resp.close()
    await pool.close()


async def test_deadlines():
    loop = asyncio.get_running_loop()
    async with ScriptedServer(lambda head, body: [0.5, plain(b"late")]) as srv:
        pool = UpstreamPool(connect_timeout=2)
        with pytest.raises(TimeoutError):
            await pool.request(srv.base, "GET", "/", [], b"", deadline=loop.time() + 0.1)
        assert pool.idle_connections() == 0  # the timed-out connection is dropped, not reused
        await pool.close()
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with ScriptedServer(lambda h, b: [head, b"1\r\na\r\n", 0.5, b"0\r\n\r\n"]) as srv:
        pool = UpstreamPool(connect_timeout=2)
        resp = await pool.request(srv.base, "GET", "/", [], b"")
        assert await resp.read_chunk(loop.time() + 0.3) == b"a"
        with pytest.raises(TimeoutError):
            await resp.read_chunk(loop.time() + 0.1)
        resp.close()
        await pool.close()


async def test_a_slow_reader_pauses_the_socket():
    big = b"y" * (4 << 20)
    async with ScriptedServer(lambda head, body: [plain(big)]) as srv:
        pool = UpstreamPool(connect_timeout=2)
        resp = await pool.request(srv.base, "GET", "/", [], b"")
        await asyncio.sleep(0.2)  # the server writes as fast as the router lets it; nobody reads
        assert resp._paused and resp._buffered < 2 << 20  # bounded, not the whole 4 MiB
        assert await read_all(resp) == big
        await pool.close()


def test_origin_from_url():
    o = Origin.from_url("https://user:p%40ss@engine.internal/base/")
    assert (o.host, o.port, o.tls, o.host_header, o.base_path) == ("engine.internal", 443, True,
                                                                   "engine.internal", "/base")
    assert o.authorization == "Basic dXNlcjpwQHNz"  # user:p@ss
    v6 = Origin.from_url("http://[::1]:8000")
    assert (v6.host, v6.port, v6.host_header, v6.base_path, v6.authorization) == ("::1", 8000, "[::1]:8000", "",
                                                                                   None)


async def test_idle_connections_expire():
    answer = lambda head, body: [plain(b"{}")]  # noqa: E731
    async with ScriptedServer(answer) as a, ScriptedServer(answer) as b:
        pool = UpstreamPool(connect_timeout=2, keepalive_timeout=0.1)
        resps = [await pool.request(a.base, "GET", "/", [], b"") for _ in range(3)]  # three at once
        for r in resps:
            await read_all(r)
            r.release()
        assert pool.idle_connections() == 3
        await asyncio.sleep(0.15)
        resp = await pool.request(a.base, "GET", "/", [], b"")  # the idle ones are too old to reuse
        await read_all(resp)
        resp.release()
        assert a.connections == 4 and pool.idle_connections() == 1
        await asyncio.sleep(0.15)
        resp = await pool.request(b.base, "GET", "/", [], b"")
        await read_all(resp)
        resp.release()  # any release after keepalive_timeout sweeps what idled out meanwhile, everywhere
        assert pool.idle_connections() == 1 and not pool._idle[Origin.from_url(a.base)]
        await pool.close()


def test_the_client_benchmark_runs():
    """benchmarks/upstream_client.py in a tiny configuration: both clients complete and numbers come out."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "upstream_client.py"
    out = subprocess.run([sys.executable, str(script), "--requests", "200", "--connections", "4", "--rounds", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = dict(re.findall(r"^(aiohttp ClientSession|UpstreamPool)\s+([\d.]+)\s", out.stdout, re.M))
    assert set(rows) == {"aiohttp ClientSession", "UpstreamPool"} and all(float(v) > 0 for v in rows.values())
    assert "UpstreamPool uses" in out.stdout


async def test_a_sink_takes_chunks_as_they_arrive_until_it_refuses_one():
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    steps: list[bytes | float | None] = [head]
    for i in range(6):
        steps += [b"2\r\nc%d\r\n" % i, 0.02]
    async with ScriptedServer(lambda h, b: [*steps, b"0\r\n\r\n"]) as srv:
        pool = UpstreamPool(connect_timeout=2)
        resp = await pool.request(srv.base, "GET", "/", [], b"")
        taken: list[bytes] = []

        def sink(data: bytes) -> bool:  # takes three, then refuses
            if len(taken) < 3:
                taken.append(data)
                return True
            return False

        first = await resp.read_chunk()
        refused = await resp.read_chunk(sink=sink, idle_timeout=1.0)
        rest = await read_all(resp)
        assert first == b"c0" and taken == [b"c1", b"c2", b"c3"] and refused == b"c4" and rest == b"c5"
        await pool.close()


async def test_idle_timeout_counts_from_the_last_chunk_the_sink_took():
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    paced: list[bytes | float | None] = [head]
    for _ in range(8):  # 0.4 s of chunks 0.05 s apart, then silence
        paced += [b"1\r\nx\r\n", 0.05]
    async with ScriptedServer(lambda h, b: [*paced, 1.0, b"0\r\n\r\n"]) as srv:
        pool = UpstreamPool(connect_timeout=2)
        resp = await pool.request(srv.base, "GET", "/", [], b"")
        assert await resp.read_chunk() == b"x"  # the first, which came with the head
        taken: list[bytes] = []
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await resp.read_chunk(sink=lambda d: taken.append(d) is None, idle_timeout=0.15)
        waited = loop.time() - start
        assert len(taken) >= 5 and 0.35 < waited < 0.9  # kept alive by the flow, cut 0.15 s after it stopped
        resp.close()
        await pool.close()


async def test_https_instances(tmp_path):
    """An https:// base URL: TLS with certificate and host name checks (a self-signed certificate for
    127.0.0.1, trusted through the pool's context; the default context refuses it)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(plain(b'{"tls":true}'))
        await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    base = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        trusting = UpstreamPool(connect_timeout=2, tls=ssl.create_default_context(cafile=str(cert)))
        resp = await trusting.request(base, "GET", "/", [], b"")
        assert resp.status == 200 and await read_all(resp) == b'{"tls":true}'
        resp.release()
        await trusting.close()
        strict = UpstreamPool(connect_timeout=2)
        with pytest.raises(ConnectError, match="certificate"):
            await strict.request(base, "GET", "/", [], b"")
        await strict.close()
    finally:
        server.close()
