"""The emulated engine's KV-cache events, published as vLLM publishes them (`--kv-events-config`).

A ZMQ PUB socket sends one message per batch: [topic, 8-byte big-endian sequence number (from 0), msgpack
[ts, [events...], data_parallel_rank]], events as maps tagged by "type" (vLLM's current encoding, None fields
left out). The endpoint binds when it has a `*` (tcp://*:5557), else connects. An optional ROUTER socket at
`replay_endpoint` answers [b"", 8-byte start sequence number] with [b"", topic, seq, payload] for every
buffered batch from there on, then [b"", b"", seq -1, b""]. Written from the format, not from the router's
decoder, so the router is tested against an independent implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger("warmroute.engine")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
FLUSH_EVERY_S = 0.005  # batches are sent at most this long after their first event (vLLM: once per step)


class KvEventPublisher:
    def __init__(self, endpoint: str, topic: str = "kv-events", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, data_parallel_rank: int = 0, bind: bool | None = None) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.pending: list[dict[str, Any]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _attach(self._pub, endpoint, bind)
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _attach(self._replay, replay_endpoint, bind=True)
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start(): batches then flush on their own

    # -- what the block pool reports -------------------------------------------------------------------------
    def stored(self, block_hashes: list[int], parent_hash: int | None, token_ids: list[int], block_size: int,
               lora_name: str | None = None) -> None:
        event: dict[str, Any] = {"type": "BlockStored", "block_hashes": block_hashes,
                                 "parent_block_hash": parent_hash, "token_ids": token_ids,
                                 "block_size": block_size, "lora_id": None, "medium": "GPU",
                                 "lora_name": lora_name}
        self._add(event)

    def removed(self, block_hashes: list[int]) -> None:
        self._add({"type": "BlockRemoved", "block_hashes": block_hashes, "medium": "GPU"})

    def cleared(self) -> None:
        self._add({"type": "AllBlocksCleared"})

    def _add(self, event: dict[str, Any]) -> None:
        self.pending.append(event)
        if len(self.pending) == 1 and self._loop is not None:  # the first of a batch: send it soon
            self._loop.call_later(FLUSH_EVERY_S, self.flush)

    # -- the wire -------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Publish the pending events as one batch (a PUB socket never blocks: a slow subscriber loses it, and
        finds the gap by its sequence number)."""
        if not self.pending or self._pub.closed:
            return
        payload = self._encoder.encode([time.time(), self.pending, self.rank])
        self.pending = []
        self.publish_raw(payload)

    def publish_raw(self, payload: bytes) -> None:
        """Send one payload with the next sequence number (also how tests put a bad payload on the wire)."""
        seq, self.seq = self.seq, self.seq + 1
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big", signed=True), payload), flags=zmq.NOBLOCK)
        self.buffer.append((seq, payload))

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._replay is not None:
            self._tasks.append(asyncio.create_task(self._serve_replay(), name="warmroute-kv-replay"))

    async def close(self) -> None:
        self.flush()
        self._loop = None
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.destroy(linger=0)  # term() would block for as long as any socket of it stayed open

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: ignoring a malformed replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _attach(sock: zmq.Socket, endpoint: str, bind: bool | None = None) -> str:
    """Bind (port 0: any free one; returns the endpoint actually bound) or connect; `bind` None: vLLM's rule,
    bind a `*` or ipc endpoint, connect the others."""
    if bind or (bind is None and ("*" in endpoint or endpoint.startswith(("ipc://", "inproc://")))):
        if endpoint.endswith(":0"):
            port = sock.bind_to_random_port(endpoint.rsplit(":", 1)[0])
            return f"{endpoint.rsplit(':', 1)[0]}:{port}"
        sock.bind(endpoint)
        return endpoint
    sock.connect(endpoint)
    return endpoint
