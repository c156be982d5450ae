"""Bad input through real HTTP: property tests (hypothesis) and a short mutation fuzz of raw requests.

Every malformed request gets a 4xx (a JSON error when it reaches the application; the HTTP parser's own plain
400 when it is not even HTTP) or is cut off by a timeout; nothing malformed reaches an instance; the router
stays up and a good request sent meanwhile is unaffected. One router serves the whole module from a thread
of its own, so the test code can use plain blocking sockets and hypothesis's ordinary (sync) API.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_upstream import CHAT, Upstream, router_for

HEADER_TIMEOUT = 0.5  # client_header_timeout of the router under test
BODY_TIMEOUT = 0.5  # idle_timeout: the most time between two pieces of a body
MAX_BODY = 64 * 1024


class Stack:
    """An echo upstream and a router in a background event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.up: Upstream = self.call(Upstream("a").start())
        self.router = self.call(router_for(self.up, max_body_bytes=MAX_BODY, client_header_timeout=HEADER_TIMEOUT,
                                           idle_timeout=BODY_TIMEOUT))
        self.port = self.router.port

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.call(self.router.stop())
        self.call(self.up.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def request(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def raw(self, data: bytes, timeout: float = 5.0) -> bytes:
        """Send raw bytes, read until the router closes the connection (b'' if it closes without answering)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            try:
                s.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass
            out = b""
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    chunk = s.recv(65536)
                except ConnectionResetError:
                    break
                except TimeoutError:  # answered, then aiohttp lingers reading the unread body: an answer
                    if out:
                        break
                    raise AssertionError(f"no answer within {timeout}s") from None
                if not chunk:
                    break
                out += chunk
                s.settimeout(0.3)  # the rest of an answer comes at once; then only lingering is left
            else:
                raise AssertionError(f"no end of answer within {timeout}s")
            return out

    def good(self) -> None:
        status, headers, body = self.request("/v1/chat/completions", json.dumps(CHAT).encode())
        assert status == 200, body
        assert json.loads(body)["upstream"] == "a"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack()
    try:
        yield s
    finally:
        s.close()


def _assert_json_4xx(status: int, headers: dict, body: bytes) -> dict:
    assert 400 <= status < 500, (status, body[:200])
    assert headers["Content-Type"].startswith("application/json")
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["code"] == status
    return err


def _status_of(raw: bytes) -> int | None:
    if not raw.startswith(b"HTTP/1.1 "):
        return None
    return int(raw[9:12])


# -- property tests ----------------------------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4), max_leaves=20)
ROLE = st.sampled_from(["system", "user", "assistant", "tool", "", "x"]) | JSON
MESSAGE = st.fixed_dictionaries({}, optional={"role": ROLE, "content": JSON | st.text(),
                                              "name": JSON, "tool_calls": JSON})
CHAT_LIKE = st.fixed_dictionaries({}, optional={"model": JSON, "stream": JSON,
                                                "messages": st.lists(MESSAGE | JSON, max_size=4) | JSON})
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(body=st.binary(max_size=2048))
def test_any_bytes_get_200_or_a_json_4xx(stack, body):
    before = len(stack.up.seen)
    status, headers, answer = stack.request("/v1/chat/completions", body)
    if status != 200:
        _assert_json_4xx(status, headers, answer)
        assert len(stack.up.seen) == before  # nothing malformed is forwarded


@FAST
@given(doc=CHAT_LIKE | JSON, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                                      "/v1/responses"]))
def test_any_json_gets_200_or_a_json_400(stack, doc, path):
    status, headers, answer = stack.request(path, json.dumps(doc).encode())
    if status != 200:
        assert status == 400
        _assert_json_4xx(status, headers, answer)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(1, 200_000), opener=st.sampled_from([b"[", b'{"a":', b'{"messages":[']))
def test_deep_nesting_is_a_400_or_passes(stack, depth, opener):
    body = opener * depth
    if len(body) > MAX_BODY:
        status, headers, answer = stack.request("/v1/chat/completions", body)
        assert status == 413
    else:
        status, headers, answer = stack.request("/v1/chat/completions", body)
        assert status == 400  # unterminated (and maybe too deep): never forwarded
    _assert_json_4xx(status, headers, answer)


@FAST
@given(text=st.text(min_size=1, max_size=64), bad=st.binary(min_size=1, max_size=4).filter(
    lambda b: _not_utf8(b)))
def test_invalid_utf8_is_a_400(stack, text, bad):
    body = b'{"messages":[{"role":"user","content":"' + text.encode().replace(b'"', b"") + bad + b'"}]}'
    _assert_json_4xx(*stack.request("/v1/chat/completions", body))


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return b"\\" not in b and b'"' not in b
    return False


@FAST
@given(value=st.text(alphabet=st.characters(codec="latin-1"), min_size=1, max_size=40), where=st.integers(0, 40),
       eol=st.sampled_from([b"\r", b"\r\n ", b"\r\n\t", b"\x00", b"\r\r\n", b"\x0b", b"\x0c"]))
def test_header_injection_never_reaches_the_instance(stack, value, where, eol):
    """A bare CR, an obs-fold continuation or a control byte inside a header value: the HTTP parser refuses
    the request, or the value stays one value; no 'Injected' header ever appears upstream, and no header value
    sent upstream holds CR or LF. (A real CRLF ends the header line: a second header the client itself sent.)"""
    v = value.encode("latin-1")
    v = v[:where] + eol + b"Injected: yes" + v[where:]
    body = json.dumps(CHAT).encode()
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\nX-Test: " + v +
           b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    before = len(stack.up.seen)
    status = _status_of(stack.raw(req))
    assert status is None or status in (200, 400), status
    for _, _, headers, _ in stack.up.seen[before:]:
        assert "Injected" not in headers and "injected" not in {k.lower() for k in headers}
        for k, val in headers.items():
            assert "\r" not in val and "\n" not in val and "\r" not in k and "\n" not in k


# -- slow clients --------------------------------------------------------------------------------------------
def _trickle(port: int, data: bytes, gap: float, limit: float) -> tuple[bytes, float]:
    """Send `data` one byte every `gap` seconds; stop when the router closes or answers. (answer, seconds)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as s:
        s.setblocking(False)
        out = b""
        for byte in data:
            if time.monotonic() - start > limit:
                raise AssertionError(f"still connected after {limit}s")
            try:
                s.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                return out, time.monotonic() - start
            time.sleep(gap)
            try:
                chunk = s.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                return out, time.monotonic() - start
            if not chunk:
                return out, time.monotonic() - start
            out += chunk
        raise AssertionError("the whole slow request was accepted")


def test_slowloris_headers_are_cut_off(stack):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n" + b"X-Slow: " + b"a" * 400 + b"\r\n\r\n"
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=_trickle(stack.port, head, 0.02, 5)))
    t.start()
    time.sleep(0.1)
    start = time.monotonic()
    stack.good()  # a good request meanwhile is unaffected
    assert time.monotonic() - start < 1.0
    t.join(10)
    answer, took = result["r"]
    assert answer == b"" and took < HEADER_TIMEOUT + 1.0  # cut off, without an answer
    print(f"\nslowloris headers cut after {took:.2f}s (client_header_timeout {HEADER_TIMEOUT}s)")


def test_a_stalled_body_gets_a_408(stack):
    """idle_timeout bounds the gap between two pieces of a body (a slow upload goes through:
    test_router_hardening.py), so a client that stops sending mid-body is answered 408 that long after."""
    body = json.dumps(CHAT).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", stack.port), timeout=5) as s:
        s.sendall(head)
        start = time.monotonic()
        answer, _ = _trickle_on(s, body[:len(body) // 2], 0.02, 5)
        s.settimeout(5)
        while b"\r\n\r\n" not in answer and (chunk := s.recv(65536)):
            answer += chunk
        took = time.monotonic() - start
    assert _status_of(answer) == 408 and b"idle_timeout" in answer
    assert took < len(body) // 2 * 0.03 + BODY_TIMEOUT + 1.0
    stack.good()


def _trickle_on(s: socket.socket, data: bytes, gap: float, limit: float) -> tuple[bytes, float]:
    start = time.monotonic()
    s.setblocking(False)
    out = b""
    for byte in data:
        assert time.monotonic() - start < limit
        try:
            s.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(gap)
        try:
            chunk = s.recv(65536)
        except BlockingIOError:
            continue
        if not chunk:
            break
        out += chunk
        if b"\r\n\r\n" in out:
            break
    return out, time.monotonic() - start


def test_huge_bodies_are_413_and_the_router_stays_up(stack):
    status, headers, answer = stack.request("/v1/completions", b'{"prompt": "' + b"x" * (MAX_BODY * 4) + b'"}')
    assert status == 413 and _assert_json_4xx(status, headers, answer)
    huge_header = {"X-Big": "y" * 100_000}  # past the HTTP parser's field limit: its own 400
    status = _status_of(stack.raw(b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\nX-Big: " +
                                  huge_header["X-Big"].encode() + b"\r\n\r\n"))
    assert status in (400, 431, None)
    stack.good()


# -- a short mutation fuzz of raw requests -----------------------------------------------------------------------
_SEEDS = [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n%s",
    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    b"%x\r\n%s\r\n0\r\n\r\n",
]
_SPECIAL = [b"\r", b"\n", b"\r\n", b"\x00", b"\xff", b"{", b"}", b"[", b'"', b"\\", b":", b" ", b"%", b"0",
            b"9" * 12, b"-1", b"\r\n\r\n", b"Transfer-Encoding: chunked\r\n", b"Content-Length: 3\r\n"]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip a byte
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif op == 1:  # insert something nasty
            b[i:i] = rng.choice(_SPECIAL)
        elif op == 2:  # delete a run
            del b[i:i + rng.randint(1, 8)]
        else:  # truncate
            del b[i:]
    return bytes(b)


@pytest.mark.slow
def test_fuzz_raw_requests(stack):
    """400 mutated requests (fixed seed; 32 at a time, about 10 s): each answered (any status but 5xx) or
    closed, none hung; good requests meanwhile are all answered; the router stays up."""
    rng = random.Random(7)
    body = json.dumps(CHAT).encode()
    seeds = [_SEEDS[0] % (len(body), body), _SEEDS[1] % (len(body), body)]
    cases = [_mutate(rng, rng.choice(seeds)) for _ in range(400)]

    def one(data: bytes) -> tuple[int | None, bytes]:
        return _status_of(stack.raw(data, timeout=BODY_TIMEOUT + HEADER_TIMEOUT + 3)), data

    start = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(one, data) for data in cases]
        for _ in range(5):
            stack.good()
        results = [f.result(timeout=60) for f in futures]
    outcomes: dict[str, int] = {}
    for status, data in results:
        assert status is None or status < 500, (status, data[:300])
        kind = "closed" if status is None else str(status)
        outcomes[kind] = outcomes.get(kind, 0) + 1
    stack.good()
    print(f"\nfuzz: {len(results)} requests in {time.monotonic() - start:.1f}s: {dict(sorted(outcomes.items()))}")
