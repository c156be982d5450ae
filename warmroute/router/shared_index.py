"""Index updates shared between router replicas through Redis pub/sub (setting `redis_url`; off by default),
and between the worker processes of one router (`workers` > 1) through local datagram sockets (always).

Without it every replica knows only the prefixes it routed itself: with N replicas behind a round-robin load
balancer a replica has seen about 1/N of each prefix's requests, takes the rest for cold, and scatters them
(measured in docs/replicas.md). With it, every chain a replica records for an instance (and every one it
takes back because the request never got there) is published; every other replica records it in its own
index too. Only block hashes and instance names travel, never prompt text.

Fire and forget, on purpose: pub/sub keeps nothing, a replica that (re)connects starts from what it hears
next, a lost message costs one possible cache miss, and no request ever waits for Redis. Updates are batched
per event-loop turn into one message. If Redis is unreachable, the replica routes on its own index alone and
reconnects in the background.

Workers of one `warmroute serve` need no Redis: the parent makes one Unix datagram socket pair per worker
before forking; each worker reads its own and sends every batch to the others' (non-blocking: a worker that
falls a socket buffer behind, 4 MiB asked for and capped by net.core.rmem_max, loses updates, never blocks
another). A datagram must fit the send buffer (~200 KiB at Linux's defaults), so a chain longer than
MAX_LINK_BLOCKS blocks (≈ 1 M characters of prompt) travels as its first MAX_LINK_BLOCKS: its head, which is
what a routing decision matches on. With `redis_url` set, each worker is a replica of its own for the index (the
local sockets then carry only the dashboard's snapshots).

Message: 8-byte replica id, then entries of op (1 byte: 0 record, 1 forget), name length (1 byte), name (UTF-8),
block count (uint32 LE), blocks (uint64 LE each).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
import struct
import sys
from collections.abc import Callable, Sequence

from warmroute.core.fleet import Fleet
from warmroute.router.background import cancel_all

log = logging.getLogger("warmroute.router")

RECORD, FORGET = 0, 1
_HEAD = struct.Struct("<BB")
_COUNT = struct.Struct("<I")
RECONNECT_S = 1.0


def pack(replica: bytes, entries: list[tuple[int, str, Sequence[int]]]) -> bytes:
    out = bytearray(replica)
    for op, name, blocks in entries:
        raw = name.encode()
        out += _HEAD.pack(op, len(raw)) + raw + _COUNT.pack(len(blocks)) + _words(blocks)
    return bytes(out)


def _words(blocks: Sequence[int]) -> bytes:
    """The chain as uint64 little-endian words: a Chain's (block_hash) as they are, no int made, on
    little-endian hosts; anything else through an array."""
    if sys.byteorder == "little" and not isinstance(blocks, (list, tuple)):
        try:
            view = memoryview(blocks)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if view.format == "Q" and view.itemsize == 8 and view.ndim == 1:
                return view.tobytes()
    a = array.array("Q", blocks)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack(payload: bytes) -> tuple[bytes, list[tuple[int, str, array.array]]]:
    """(replica id, entries); ValueError on a malformed message. Each entry's blocks are an array of uint64
    (a sequence of ints; the compiled index reads its words in place)."""
    if len(payload) < 8:
        raise ValueError("message too short")
    replica, pos, entries = payload[:8], 8, []
    try:
        while pos < len(payload):
            op, n = _HEAD.unpack_from(payload, pos)
            pos += _HEAD.size
            name = payload[pos:pos + n].decode()
            pos += n
            (count,) = _COUNT.unpack_from(payload, pos)
            pos += _COUNT.size
            end = pos + 8 * count
            if end > len(payload) or op not in (RECORD, FORGET):
                raise ValueError("truncated or unknown entry")
            a = array.array("Q")
            a.frombytes(payload[pos:end])
            if sys.byteorder != "little":
                a.byteswap()
            entries.append((op, name, a))
            pos = end
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from None
    return replica, entries


class IndexUpdates:
    """What every way of sharing does: batch this process's updates per loop turn, apply the others'.
    Subclasses move the bytes (`_send`, and calling `apply` with what arrives)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.replica = os.urandom(8)
        self.received = 0  # entries applied from other replicas (tests, debugging)
        self._pending: list[tuple[int, str, Sequence[int]]] = []
        self._flush_scheduled = False
        self._client: object | None = None  # set while updates can be sent

    # -- outgoing (called on the request path: no I/O here) -----------------------------------------------------
    def recorded(self, name: str, blocks: list[int] | tuple[int, ...]) -> None:
        self._queue(RECORD, name, blocks)

    def forgotten(self, name: str, blocks: list[int] | tuple[int, ...]) -> None:
        self._queue(FORGET, name, blocks)

    def _queue(self, op: int, name: str, blocks: list[int] | tuple[int, ...]) -> None:
        if not blocks or self._client is None:
            return
        # A list could change before the flush: copied. A Chain (block_hash's) or a tuple cannot.
        self._pending.append((op, name, blocks.copy() if isinstance(blocks, list) else blocks))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        entries, self._pending = self._pending, []
        if entries and self._client is not None:
            self._send(entries)

    def _send(self, entries: list[tuple[int, str, Sequence[int]]]) -> None:
        raise NotImplementedError

    # -- incoming ----------------------------------------------------------------------------------------------
    def apply(self, payload: bytes) -> None:
        try:
            replica, entries = unpack(payload)
        except ValueError as exc:
            log.warning("shared index: malformed message ignored (%s)", exc)
            return
        if replica == self.replica:
            return
        index = self.fleet.index
        for op, name, blocks in entries:
            if name not in self.fleet.instances:
                continue  # an instance this replica does not have (yet): nothing to learn
            if op == RECORD:
                index.record(name, blocks)
            else:
                index.forget(name, blocks)
            self.received += 1


class SharedIndex(IndexUpdates):
    """Between router replicas, through Redis pub/sub (a component)."""

    name = "redis"

    def __init__(self, url: str, channel: str, fleet: Fleet) -> None:
        super().__init__(fleet)
        self.url = url
        self.channel = channel
        self._tasks: list[asyncio.Task] = []
        self._publishes: set[asyncio.Task] = set()
        self.connected = asyncio.Event()

    def _send(self, entries: list[tuple[int, str, Sequence[int]]]) -> None:
        task = asyncio.get_running_loop().create_task(self._publish(pack(self.replica, entries)))
        self._publishes.add(task)
        task.add_done_callback(self._publishes.discard)

    async def _publish(self, payload: bytes) -> None:
        try:
            await self._client.publish(self.channel, payload)  # type: ignore[attr-defined]
        except Exception as exc:  # redis.exceptions.* and OSError: an update lost, nothing else
            log.debug("shared index: publish failed: %s", exc)

    async def start(self) -> None:
        import redis.asyncio as redis

        self._client = redis.from_url(self.url)
        self._tasks.append(asyncio.create_task(self._listen(), name="warmroute-shared-index"))
        with contextlib.suppress(TimeoutError):  # do not hold start-up for long if Redis is down
            async with asyncio.timeout(2.0):
                await self.connected.wait()

    async def _listen(self) -> None:
        warned = False
        while True:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self.connected.set()
                if warned:
                    log.warning("shared index: connected to Redis again")
                    warned = False
                while True:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None and msg.get("type") == "message":
                        self.apply(msg["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.connected.clear()
                if not warned:
                    log.warning("shared index: Redis unavailable (%s); routing on this replica's index alone",
                                type(exc).__name__)
                    warned = True
                await asyncio.sleep(RECONNECT_S)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        if self._publishes:
            await asyncio.gather(*self._publishes, return_exceptions=True)
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
        self._client = None


MAX_LINK_BLOCKS = 16_384  # 128 KiB of block hashes: a datagram must stay under the socket's send buffer
_LINK_DATAGRAM = 160 * 1024  # entries are packed into datagrams of at most about this size
_LINK_BUFFER = 4 * 1024 * 1024  # asked for; Linux caps it at net.core.[rw]mem_max


_INDEX, _SNAPSHOT = b"\x00", b"\x01"  # first byte of a datagram between workers
Links = tuple[list[tuple[socket.socket, socket.socket]], int]  # every worker's (receive, send) pair; which is mine


def worker_links(count: int) -> list[tuple[socket.socket, socket.socket]]:
    """One (receive, send) Unix datagram socket pair per worker, made before forking so all inherit all."""
    links = []
    for _ in range(count):
        receive, send = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        for sock, opt in ((receive, socket.SO_RCVBUF), (send, socket.SO_SNDBUF)):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, _LINK_BUFFER)
            sock.setblocking(False)
        links.append((receive, send))
    return links


class WorkerLinks(IndexUpdates):
    """Between the worker processes of one router: worker `me` reads links[me][0], sends to the others' [1].

    Two kinds of datagram, told apart by their first byte: index updates (unless `share_index` is off because
    the workers share through Redis instead) and dashboard snapshots (`send_snapshot`, `on_snapshot`), so that
    /dashboard shows every worker's traffic whichever worker answers."""

    name = "worker-links"

    def __init__(self, fleet: Fleet, links: list[tuple[socket.socket, socket.socket]], me: int,
                 share_index: bool = True, on_snapshot: Callable[[bytes], None] | None = None) -> None:
        super().__init__(fleet)
        self._inbox = links[me][0]
        self._peers = [send for i, (_, send) in enumerate(links) if i != me]
        self.share_index = share_index
        self.on_snapshot = on_snapshot
        self.dropped = 0  # datagrams a peer had no room for

    async def start(self) -> None:
        self._client = self._peers if self.share_index else None  # None: index updates are not queued
        asyncio.get_running_loop().add_reader(self._inbox.fileno(), self._receive)

    async def stop(self) -> None:
        self._client = None
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._inbox.fileno())

    def send_snapshot(self, payload: bytes) -> None:
        self._post(_SNAPSHOT + payload)

    def _send(self, entries: list[tuple[int, str, Sequence[int]]]) -> None:
        batch: list[tuple[int, str, Sequence[int]]] = []
        size = 0
        for op, name, blocks in entries:
            blocks = blocks[:MAX_LINK_BLOCKS]
            if batch and size + 8 * len(blocks) > _LINK_DATAGRAM:
                self._post(_INDEX + pack(self.replica, batch))
                batch, size = [], 0
            batch.append((op, name, blocks))
            size += 8 * len(blocks) + len(name) + 6
        if batch:
            self._post(_INDEX + pack(self.replica, batch))

    def _post(self, payload: bytes) -> None:
        for peer in self._peers:
            try:
                peer.send(payload)
            except OSError:  # full (BlockingIOError) or gone: this update is lost for that worker
                self.dropped += 1

    def _receive(self) -> None:
        for _ in range(64):  # bounded, so one busy peer cannot hold the loop
            try:
                payload = self._inbox.recv(_LINK_DATAGRAM + 65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            kind, body = payload[:1], payload[1:]
            if kind == _INDEX and self.share_index:
                self.apply(body)
            elif kind == _SNAPSHOT and self.on_snapshot is not None:
                self.on_snapshot(body)
