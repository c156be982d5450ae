"""A raw-socket HTTP/1.1 load generator: keep-alive connections as asyncio protocols, responses parsed by
httptools, for measuring a router's saturation throughput and the latency it adds.

`aiohttp`'s client costs a few hundred microseconds of CPU per request; this one costs 20-80 (the more
requests per wake-up, the less), so on a small machine the load generator is not what saturates. Two load
shapes: `ClosedLoop` (N connections sending back to back) and `PairedStreams` (each session sends the same
request straight to an instance and through the router at the same moment).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httptools

from warmroute.bench.cpu import CpuMeter, Snapshot

SAMPLE_EVERY = 8  # keep one latency in 8 (enough for p99, little work per request)


def http_request(host: str, port: int, path: str, body: bytes) -> bytes:
    """A JSON POST on a keep-alive connection, as bytes to write."""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def hostport(url: str) -> tuple[str, int]:
    host, _, port = url.rsplit("/", 1)[-1].rpartition(":")
    return host, int(port)


class Owner(Protocol):
    def done(self, conn: Connection, end: float, error: str | None) -> None: ...


class Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time; owner.done(conn, end_time, error) as each answer ends.
    `t0` is when the request was written, `first` when the first body byte arrived."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body = bytearray()
        self.t0 = self.first = 0.0
        self.waiting = False
        self.streamed = False  # set by the owner: what kind of request is in flight

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, data: bytes) -> None:
        self.body.clear()
        self.first = 0.0
        self.waiting = True
        self.t0 = time.perf_counter()
        assert self.transport is not None
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if not self.waiting:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._finish("bad_response")

    def on_body(self, body: bytes) -> None:  # httptools callback
        if not self.first:
            self.first = time.perf_counter()
        self.body += body

    def on_message_complete(self) -> None:  # httptools callback
        status = self.parser.get_status_code()
        error = None
        if status != 200:
            error = f"http_{status}"
        elif b"[DONE]" not in self.body[-64:] and b'"choices"' not in self.body:
            error = "bad_body"
        self._finish(error, close=not self.parser.should_keep_alive())

    def _finish(self, error: str | None, close: bool = False) -> None:
        self.waiting = False
        end = time.perf_counter()
        if error is not None or close:
            self.close()
        self.owner.done(self, end, error)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.waiting:
            self.waiting = False
            self.owner.done(self, time.perf_counter(), "disconnected")


async def connect(owner: Owner, host: str, port: int) -> Connection:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(lambda: Connection(owner), host, port)
    return conn


async def _drain(idle: asyncio.Event, drain_s: float, busy: bool, conns: Iterable[Connection]) -> None:
    """Let requests in flight finish (at most `drain_s`), then close every connection."""
    if busy:
        try:
            await asyncio.wait_for(idle.wait(), drain_s)
        except TimeoutError:
            pass
    for conn in list(conns):
        conn.close()


@dataclass
class Window:
    """What one measured window saw (requests that ended inside it)."""

    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latency_s: list[float] = field(default_factory=list)  # end to end, sampled
    ttft_s: list[float] = field(default_factory=list)  # streamed requests, sampled

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class ClosedLoop:
    """`connections` keep-alive connections over `targets`, each sending its requests back to back."""

    def __init__(self, targets: Sequence[tuple[str, int]], path: str, bodies: Sequence[bytes],
                 connections: int) -> None:
        self.targets = list(targets)
        self.requests = [[http_request(h, p, path, b) for b in bodies] for h, p in self.targets]
        self.streamed = [b'"stream":true' in b for b in bodies]
        self.connections = connections
        self.window = Window()
        self.measuring = self.running = False
        self.next_index: dict[Connection, int] = {}
        self.target_of: dict[Connection, int] = {}
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.counter = 0
        self.reconnects: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.running = True
        for k in range(self.connections):
            await self._open(k % len(self.targets), k)

    async def _open(self, t: int, start: int) -> None:
        host, port = self.targets[t]
        conn = await connect(self, host, port)
        self.target_of[conn] = t
        self.next_index[conn] = start
        self._send(conn)

    def _send(self, conn: Connection) -> None:
        i = self.next_index[conn] % len(self.requests[0])
        self.next_index[conn] = i + self.connections
        self.in_flight += 1
        conn.send(self.requests[self.target_of[conn]][i])
        conn.streamed = self.streamed[i]

    def done(self, conn: Connection, end: float, error: str | None) -> None:
        self.in_flight -= 1
        if self.measuring:
            self._count(conn, end, error)
        if not self.running:
            if self.in_flight == 0:
                self.idle.set()
            return
        if conn.transport is None or conn.transport.is_closing():
            t = self.target_of.pop(conn)
            start = self.next_index.pop(conn)
            task = asyncio.get_running_loop().create_task(self._reopen(t, start))
            self.reconnects.add(task)
            task.add_done_callback(self.reconnects.discard)
            return
        self._send(conn)

    def _count(self, conn: Connection, end: float, error: str | None) -> None:
        w = self.window
        if error is not None:
            w.error(error)
            return
        w.ok += 1
        self.counter += 1
        if self.counter % SAMPLE_EVERY == 0:
            w.latency_s.append(end - conn.t0)
            if conn.streamed:
                w.ttft_s.append(conn.first - conn.t0)

    async def _reopen(self, t: int, start: int) -> None:
        try:
            await self._open(t, start)
        except OSError:
            self.window.error("connect")
            await asyncio.sleep(0.05)
            if self.running:
                await self._reopen(t, start)

    async def stop(self, drain_s: float = 5.0) -> None:
        self.running = False
        for task in list(self.reconnects):
            task.cancel()
        await _drain(self.idle, drain_s, busy=bool(self.in_flight), conns=self.target_of)


@dataclass(eq=False)
class _Session:
    k: int
    direct: Connection
    routed: Connection
    direct_req: list[bytes]
    routed_req: list[bytes]
    n: int = 0
    pending: int = 0
    error: str | None = None
    broken: bool = False


class PairedStreams:
    """`sessions` sessions; each sends one streamed request straight to an instance and the same through the
    router at the same moment (which is written first alternates), waits for both answers, repeats. Pairs
    ending inside the window are kept as (direct TTFT, router TTFT) in seconds."""

    def __init__(self, instances: Sequence[tuple[str, int]], router: tuple[str, int], path: str,
                 bodies: Sequence[bytes], sessions: int) -> None:
        self.instances, self.router, self.path, self.bodies = list(instances), router, path, list(bodies)
        self.sessions = sessions
        self.pairs: list[tuple[float, float]] = []
        self.errors: dict[str, int] = {}
        self.measuring = self.running = False
        self.state: dict[Connection, _Session] = {}
        self.active = 0
        self.idle = asyncio.Event()

    async def start(self, stagger_s: float) -> None:
        self.running = True
        rng = random.Random(1)
        for k in range(self.sessions):
            host, port = self.instances[k % len(self.instances)]
            s = _Session(k, await connect(self, host, port), await connect(self, *self.router),
                         [http_request(host, port, self.path, b) for b in self.bodies],
                         [http_request(*self.router, self.path, b) for b in self.bodies])
            self.state[s.direct] = self.state[s.routed] = s
            asyncio.get_running_loop().call_later(rng.uniform(0, stagger_s), self._go, s)

    def _go(self, s: _Session) -> None:
        if not self.running or s.broken:
            return
        i = s.n % len(self.bodies)
        s.pending, s.error = 2, None
        self.active += 1
        first, second = ((s.direct, s.direct_req), (s.routed, s.routed_req))
        if (s.k + s.n) % 2:
            first, second = second, first
        s.n += 1
        first[0].send(first[1][i])
        second[0].send(second[1][i])

    def done(self, conn: Connection, end: float, error: str | None) -> None:
        s = self.state[conn]
        if error is not None:
            s.error = error
            s.broken = s.broken or conn.transport is None or conn.transport.is_closing()
        s.pending -= 1
        if s.pending:
            return
        self.active -= 1
        if self.measuring:
            if s.error is None:
                self.pairs.append((s.direct.first - s.direct.t0, s.routed.first - s.routed.t0))
            else:
                self.errors[s.error] = self.errors.get(s.error, 0) + 1
        if self.running and not s.broken:
            self._go(s)
        elif self.active == 0:
            self.idle.set()

    async def stop(self, drain_s: float = 5.0) -> None:
        self.running = False
        await _drain(self.idle, drain_s, busy=bool(self.active), conns=self.state)


async def measured(load: Any, warmup_s: float, duration_s: float, meter: CpuMeter) -> tuple[Snapshot, Snapshot]:
    """Run a started load (ClosedLoop, PairedStreams) unmeasured for `warmup_s`, then measured for
    `duration_s`; stop it. Returns the CPU meter's snapshots at the start and end of the measured window."""
    try:
        await asyncio.sleep(warmup_s)
        a = meter.snapshot()
        load.measuring = True
        await asyncio.sleep(duration_s)
        load.measuring = False
        b = meter.snapshot()
    finally:
        await load.stop()
    return a, b
