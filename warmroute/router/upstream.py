"""The data-plane HTTP/1.1 client: pooled keep-alive connections from the router to its instances.

Every proxied request goes through here; the control plane (health checks, engine scrapes, /v1/models,
discovery) keeps aiohttp's client, which it uses a few times a second. Why a second client: aiohttp's
per-request machinery (URL and header objects, its request/response classes, a task wake-up per chunk through
its stream reader) costs several times this one's CPU per request (docs/tuning.md). It is an asyncio protocol
around httptools (llhttp, Node.js's HTTP parser, from the uvloop authors) that
  * writes the request head and body as they are (the caller filters the headers; Host and Content-Length
    are set here), with no retries of its own but one: a reused keep-alive connection that closes before any
    byte of an answer (the instance closed it while idle) is replaced by a fresh one;
  * hands back the status and headers, then the body chunk by chunk as it arrives (chunked framing decoded,
    content never decompressed), pausing the socket when the reader falls 256 KiB behind;
  * returns a connection to the pool only when its answer was read to the end and both sides keep it alive;
    `close()` drops it at once, which is how the instance learns that nobody waits for the answer.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httptools
from multidict import CIMultiDict

_PAUSE_AT = 256 * 1024  # buffered answer bytes at which the socket stops being read
_RESUME_AT = 64 * 1024
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # Content-Length even when empty, as clients send it


ServerNames = dict[tuple[str, int], str]  # (address, port) of an https:// instance -> the host name it serves


class ConnectError(Exception):
    """No connection could be opened: nothing was sent. `timed_out`: it was not refused, only slow to be
    accepted (an overloaded instance can be)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class UpstreamError(Exception):
    """The connection failed or the answer was malformed after the request was sent."""


@dataclass(frozen=True)
class Origin:
    """Where one base URL's requests go, parsed once."""

    host: str
    port: int
    tls: bool
    host_header: str
    base_path: str  # the base URL's path, prepended to every request's target
    authorization: str | None  # Basic credentials from the URL's user info, if any

    server_name: str | None = None  # TLS: the name sent as SNI and verified, when the host is an address

    @classmethod
    def from_url(cls, url: str, server_names: ServerNames | None = None) -> Origin:
        """`server_names`: (address, port) -> host name, for instances reached by an address their host name
        resolved to (discovery.py): TLS and the Host header then use the name, not the address."""
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or ""
        port = parts.port or (443 if tls else 80)
        name = server_names.get((host, port)) if server_names and tls else None
        shown = name or (f"[{host}]" if ":" in host else host)
        host_header = shown if port == (443 if tls else 80) else f"{shown}:{port}"
        auth = None
        if parts.username is not None:
            creds = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            auth = "Basic " + base64.b64encode(creds).decode()
        return cls(host, port, tls, host_header, parts.path.rstrip("/"), auth, name)


class UpstreamResponse:
    """One answer: status and headers at once, the body as it arrives."""

    __slots__ = ("status", "reason", "headers", "content_length", "_conn", "_chunks", "_buffered", "_complete",
                 "_error", "_waiter", "_paused", "_settled", "_sink", "_last_data", "_timer")

    def __init__(self, conn: _Connection, status: int, reason: str, headers: CIMultiDict[str]) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._settled = False  # released or closed
        self._sink: Callable[[bytes], bool] | None = None  # takes chunks as they arrive while read_chunk waits
        self._last_data = 0.0  # time.monotonic() of the last chunk handed to the sink
        self._timer: asyncio.TimerHandle | None = None  # the idle check while read_chunk waits

    # -- reading ---------------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """A chunk, the end or an error can be read without waiting."""
        return bool(self._chunks) or self._complete or self._error is not None

    def read_nowait(self) -> bytes:
        """Everything buffered, joined; b"" at the end. Raises the connection's error once the buffer is empty."""
        if not self._chunks:
            if self._error is not None:
                raise self._error
            return b""
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._drain())
        self._consumed(len(data))
        return data

    async def read_chunk(self, deadline: float | None = None, sink: Callable[[bytes], bool] | None = None,
                         idle_timeout: float | None = None) -> bytes:
        """The next chunk as it arrived; b"" once the answer is complete. TimeoutError if nothing came by
        `deadline` (the loop's clock), or, with `idle_timeout`, if nothing came for that many seconds.

        `sink`: while this waits, each chunk that arrives is offered to sink(chunk) first, right in the
        socket's callback; only one it refuses (returns False) ends the wait and is returned. A relay writes
        to its client that way without a task wake-up per chunk (warmroute/router/proxy.py)."""
        if not self.ready():
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            self._sink, self._last_data = sink, time.monotonic()
            if idle_timeout:
                self._timer = loop.call_later(idle_timeout, self._check_idle, idle_timeout)
            try:
                await _until(waiter, deadline)
            finally:
                self._waiter = self._sink = None
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
        if self._chunks:
            data = self._chunks.popleft()
            self._consumed(len(data))
            return data
        return self.read_nowait()

    def _check_idle(self, idle_timeout: float) -> None:
        """The idle timer: fails the wait if nothing came for idle_timeout, else looks again when it would."""
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        quiet = time.monotonic() - self._last_data
        if quiet >= idle_timeout:
            waiter.set_exception(TimeoutError())
        else:
            self._timer = asyncio.get_running_loop().call_later(idle_timeout - quiet, self._check_idle, idle_timeout)

    def _drain(self) -> list[bytes]:
        chunks = list(self._chunks)
        self._chunks.clear()
        return chunks

    def _consumed(self, n: int) -> None:
        self._buffered -= n
        if self._paused and self._buffered <= _RESUME_AT:
            self._paused = False
            self._conn.resume_reading()

    # -- fed by the connection -------------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        if self._sink is not None and not self._chunks and self._sink(data):
            self._last_data = time.monotonic()
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if not self._paused and self._buffered >= _PAUSE_AT:
            self._paused = True
            self._conn.pause_reading()
        self._wake()

    def _end(self, error: Exception | None = None) -> None:
        if error is None:
            self._complete = True
        elif not self._complete:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- giving the connection back --------------------------------------------------------------------------
    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool if it can carry another request."""
        if not self._settled:
            self._settled = True
            self._conn.finished(reusable=self._complete and not self._chunks)

    def close(self) -> None:
        """Drop the connection now (the instance sees the disconnect and stops working on the request)."""
        if not self._settled:
            self._settled = True
            self._conn.finished(reusable=False)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._head_only = False
        self._received = False  # any byte of the current answer
        self._reason = ""
        self._headers: list[tuple[str, str]] = []
        self._answer: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._closed = False
        self._keep_alive = True
        self._until_close = False

    # -- asyncio.Protocol ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._answer is None:  # bytes on an idle connection (a 408 before closing it): never reuse it
            self.abort()
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("the instance switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed answer from the instance: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.pool._forget(self)
        if self._response is not None and self._until_close:
            self._response._end()  # an answer framed by the end of the connection (no length, not chunked)
        what = "the instance closed the connection" + ("" if self._received else " before answering")
        self._settle(UpstreamError(what))

    def pause_reading(self) -> None:
        if self.transport is not None and not self._closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self._closed:
            self.transport.resume_reading()

    # -- httptools callbacks ---------------------------------------------------------------------------------
    # UTF-8 (what aiohttp encodes them with again on the way out), so they pass through byte for byte;
    # invalid bytes become U+FFFD rather than an error.
    def on_status(self, reason: bytes) -> None:
        self._reason = reason.decode("utf-8", "replace")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("utf-8", "replace")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # informational (103 Early Hints): the real answer follows
            self._headers = []
            return
        self._keep_alive = self._parser.should_keep_alive()
        resp = UpstreamResponse(self, status, self._reason, CIMultiDict(self._headers))
        self._headers = []
        self._response = resp
        self._until_close = (resp.content_length is None and status not in (204, 304) and not self._head_only
                             and "chunked" not in resp.headers.get("Transfer-Encoding", "").lower())
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(resp)
        if self._head_only:  # an answer to HEAD has no body, whatever its Content-Length says
            self._keep_alive = False
            resp._end()

    def on_body(self, body: bytes) -> None:
        if self._response is not None and not self._head_only:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._response is not None:
            self._response._end()

    # -- requests --------------------------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes, head_only: bool) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        self._head_only = head_only
        self._until_close = False
        self._received = False
        self._response = None
        self._answer = asyncio.get_running_loop().create_future()
        if self._closed or self.transport.is_closing():  # closed by the instance just now, while idle
            self._answer.set_exception(UpstreamError("the instance closed the connection before answering"))
        elif body and len(body) <= 65536:
            self.transport.write(head + body)  # one write, one segment
        else:
            self.transport.write(head)
            if body:
                self.transport.write(body)
        return self._answer

    def finished(self, reusable: bool) -> None:
        """The caller is done with the current answer."""
        self._response = None
        self._answer = None
        if reusable and self._keep_alive and not self._closed:
            self.pool._put(self)
        else:
            self.abort()

    def abort(self) -> None:
        self._closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, error: UpstreamError) -> None:
        self._settle(error)
        self.abort()

    def _settle(self, error: UpstreamError) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(error)
        if self._response is not None:
            self._response._end(error)


class UpstreamPool:
    """Keep-alive connections per instance, newest reused first, closed after `keepalive_timeout` idle."""

    def __init__(self, connect_timeout: float, keepalive_timeout: float = 4.0,
                 tls: ssl.SSLContext | None = None, server_names: ServerNames | None = None) -> None:
        self.server_names = server_names  # shared with discovery, which fills it
        self.connect_timeout = connect_timeout
        self.keepalive_timeout = keepalive_timeout  # below uvicorn's 5 s (vLLM): never reuse one it is closing
        self._origins: dict[str, Origin] = {}
        self._idle: dict[Origin, list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._ssl = tls  # for https:// instances; the system's trust store when None
        self._swept = time.monotonic()

    async def request(self, base_url: str, method: str, target: str, headers: list[tuple[str, str]],
                      body: bytes, deadline: float | None = None) -> UpstreamResponse:
        """Send one request; returns once the answer's status and headers are in. ConnectError if no
        connection could be opened; UpstreamError if it failed after the request went out; TimeoutError if
        the headers were not in by `deadline` (the loop's clock)."""
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = Origin.from_url(base_url, self.server_names)
        head = _request_head(method, origin, target, headers, len(body))
        head_only = method == "HEAD"
        conn = self._take(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, head, body, head_only, deadline)
            except UpstreamError:
                if conn._received:
                    raise
                # closed while idle, as we reused it: nothing was answered, so a fresh connection may try
        return await self._exchange(await self._connect(origin, deadline), head, body, head_only, deadline)

    async def _exchange(self, conn: _Connection, head: bytes, body: bytes, head_only: bool,
                        deadline: float | None) -> UpstreamResponse:
        try:
            return await _until(conn.send(head, body, head_only), deadline)
        except BaseException:  # failed, or the caller was cancelled: the connection cannot be reused
            conn.abort()
            raise

    async def _connect(self, origin: Origin, deadline: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        context = self._tls() if origin.tls else None
        limit, cut_by_deadline = self.connect_timeout, False
        if deadline is not None and deadline - loop.time() < limit:
            limit, cut_by_deadline = max(0.0, deadline - loop.time()), True
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(lambda: _Connection(self, origin), origin.host, origin.port,
                                                       ssl=context,
                                                       server_hostname=(origin.server_name or origin.host) if context
                                                       else None)
        except TimeoutError:
            if cut_by_deadline:
                raise
            raise ConnectError(f"no connection to {origin.host}:{origin.port} within {self.connect_timeout:g} s",
                               timed_out=True) from None
        except OSError as exc:  # refused, unreachable, DNS, TLS handshake
            raise ConnectError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from None
        self._all.add(conn)
        return conn

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        conn = idle.pop()
        if time.monotonic() - conn.idle_since < self.keepalive_timeout and not conn._closed:
            return conn
        stale = [conn, *idle]  # the rest went idle earlier still
        idle.clear()
        for c in stale:
            c.abort()
        return None

    def _put(self, conn: _Connection) -> None:
        now = conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.origin, []).append(conn)
        if now - self._swept > self.keepalive_timeout:  # close what idled out (a burst's extra connections)
            self._swept = now
            for idle in self._idle.values():
                expired = [c for c in idle if now - c.idle_since >= self.keepalive_timeout]
                for c in expired:
                    idle.remove(c)
                    c.abort()

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def close(self) -> None:
        """Drop every connection (the router is stopping; requests still running were cancelled before)."""
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports report connection_lost


async def _until(future: asyncio.Future, deadline: float | None):  # type: ignore[type-arg]
    """Await `future`, failing it with TimeoutError at `deadline`: one timer handle, cheaper than
    asyncio.timeout's context manager on the path every request and every relayed chunk takes."""
    if deadline is None:
        return await future
    handle = asyncio.get_running_loop().call_at(deadline, _expire, future)
    try:
        return await future
    finally:
        handle.cancel()


def _expire(future: asyncio.Future) -> None:  # type: ignore[type-arg]
    if not future.done():
        future.set_exception(TimeoutError())


def _request_head(method: str, origin: Origin, target: str, headers: list[tuple[str, str]], length: int) -> bytes:
    lines = [f"{method} {origin.base_path}{target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
    has_auth = False
    for name, value in headers:
        lines.append(f"{name}: {value}\r\n")
        has_auth = has_auth or (origin.authorization is not None and name.lower() == "authorization")
    if origin.authorization is not None and not has_auth:
        lines.append(f"Authorization: {origin.authorization}\r\n")
    if length or method in _BODY_METHODS:
        lines.append(f"Content-Length: {length}\r\n")
    lines.append("\r\n")
    # Header values came through aiohttp's parser as UTF-8 with surrogate escapes: this gives back their bytes.
    return "".join(lines).encode("utf-8", "surrogateescape")
