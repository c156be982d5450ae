"""KV-cache events as engines publish them (vLLM's ZMQ format, also SGLang's), decoded; no I/O.

A message is three frames: topic, an 8-byte big-endian sequence number, and a msgpack payload
`[ts, [events...], data_parallel_rank]`. An event is a map tagged by "type" (vLLM from mid-2026) or a positional
array whose first element is the tag (older vLLM, SGLang), one of:
  BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, ...}
  BlockRemoved{block_hashes, medium, ...}
  AllBlocksCleared{}
Block hashes are unsigned 64-bit ints, or bytes (a whole digest) where the engine is so configured: both become
ints here (bytes by their low 64 bits), which is all an index needs to resolve later removals.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

_M64 = (1 << 64) - 1
SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)  # a replay's terminator
# An endpoint the router can connect a ZMQ socket to (also what a backend entry may give).
ZMQ_ENDPOINT = r"^(tcp://[^\s/]+:\d{1,5}|ipc://\S+)$"
# Field order of the positional (array-like) encoding, after the tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_GPU_MEDIA = (None, "GPU")  # blocks offloaded to CPU or storage are not in the engine's prefix cache


class BadMessage(ValueError):
    """A message (or an event in it) that is not in the format: counted and skipped by the subscriber."""


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None  # from the first block's extra keys, where the chain starts here


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[Event] = field(default_factory=list)
    data_parallel_rank: int | None = None
    skipped: int = 0  # events in it that were malformed, of an unknown type, or not about the GPU prefix cache


def replay_frames(frames: list[bytes]) -> list[bytes] | None:
    """One message from an engine's replay socket (as a DEALER receives it, after the empty delimiter) as a live
    message's three frames (topic, sequence, payload); None for the end of the replay; BadMessage otherwise.
    vLLM's framings differ between versions: [b"", topic, seq, payload] per batch and [b"", b"", END_SEQ, b""]
    at the end (0.32), or [b"", seq, payload] and [b"", END_SEQ, b""] (others)."""
    if not frames or frames[0] != b"":
        raise BadMessage("a replayed message must start with an empty delimiter frame")
    if len(frames) == 4:
        return None if frames[2] == END_SEQ else frames[1:]
    if len(frames) == 3:
        return None if frames[1] == END_SEQ else [b"", frames[1], frames[2]]
    raise BadMessage(f"a replayed message has {len(frames)} frames, expected 3 or 4")


def decode_seq(frame: bytes) -> int:
    """The sequence number frame: 8 bytes, big-endian, signed (a replay's terminator is -1)."""
    if len(frame) != SEQ_BYTES:
        raise BadMessage(f"sequence frame is {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_batch(payload: bytes) -> EventBatch:
    """One payload -> its events; BadMessage if the payload itself is unreadable. Events that cannot be read are
    counted in `skipped`, so one bad event does not lose the batch's others."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise BadMessage(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise BadMessage("payload is not [ts, [events...], data_parallel_rank]")
    ts = raw[0] if isinstance(raw[0], (int, float)) and not isinstance(raw[0], bool) else 0.0
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    batch = EventBatch(float(ts), [], rank)
    for item in raw[1]:
        try:
            event = decode_event(item)
        except BadMessage:
            event = None
        if event is None:
            batch.skipped += 1
        else:
            batch.events.append(event)
    return batch


def decode_event(item: Any) -> Event | None:
    """One event (tagged map or positional array); None for one that is well formed but not ours to index
    (another medium or KV-cache group); BadMessage for one that is malformed or of an unknown type."""
    if isinstance(item, dict):
        tag, fields = item.get("type"), item
    elif isinstance(item, list) and item:
        tag = item[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        fields = dict(zip(names, item[1:]))
    else:
        raise BadMessage("an event must be a map or an array")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag not in ("BlockStored", "BlockRemoved"):
        raise BadMessage(f"unknown event type {tag!r}")
    if fields.get("medium") not in _GPU_MEDIA or fields.get("group_idx") not in (None, 0):
        return None
    hashes = _hashes(fields.get("block_hashes"))
    if tag == "BlockRemoved":
        return BlockRemoved(hashes)
    return _stored(fields, hashes)


def _stored(fields: dict, hashes: list[int]) -> BlockStored:
    tokens, size = fields.get("token_ids"), fields.get("block_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise BadMessage("BlockStored.block_size must be a positive integer")
    if not isinstance(tokens, list) or len(tokens) != size * len(hashes):
        raise BadMessage("BlockStored.token_ids must hold block_size tokens per block hash")
    if not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens):
        raise BadMessage("BlockStored.token_ids must be integers from 0 to 2^32-1")
    parent = fields.get("parent_block_hash")
    lora = fields.get("lora_name")
    lora = lora if isinstance(lora, str) and lora else None
    return BlockStored(hashes, None if parent is None else _hash(parent), tokens, size, lora,
                       _cache_salt(fields.get("extra_keys"), lora) if parent is None else None)


def _cache_salt(extra_keys: Any, lora: str | None) -> str | None:
    """The first block's cache salt: the string among its extra keys that is not the LoRA name (vLLM publishes
    them untagged, in order: LoRA name, multimodal pairs, cache salt)."""
    if not isinstance(extra_keys, list) or not extra_keys or not isinstance(extra_keys[0], (list, tuple)):
        return None
    strings = [k for k in extra_keys[0] if isinstance(k, str)]
    if lora is not None and strings and strings[0] == lora:
        strings = strings[1:]
    return strings[-1] if strings else None


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise BadMessage("block_hashes must be a non-empty list")
    return [_hash(h) for h in value]


def _hash(h: Any) -> int:
    if isinstance(h, int) and not isinstance(h, bool):
        return h & _M64
    if isinstance(h, (bytes, bytearray)) and h:
        return int.from_bytes(h[-8:], "big")
    raise BadMessage("a block hash must be an integer or bytes")


# -- where an instance publishes (vLLM's GET /kv_event_sources) -----------------------------------------------------
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "[*]")


@dataclass(frozen=True, slots=True)
class EventSource:
    endpoint: str  # the publisher's PUB socket, as the router connects to it
    replay_endpoint: str | None


def source_from_vllm(body: Any, host: str) -> tuple[EventSource | None, str]:
    """What vLLM's `GET /kv_event_sources` says (`{dp_rank: KVEventsConfig}`), as endpoints at `host` (the
    instance's address: vLLM reports the wildcard it bound), and a note saying why not where it cannot be used.
    Only the lowest data-parallel rank's stream is followed: the router sees one instance per URL."""
    if not isinstance(body, dict):
        raise BadMessage("expected a JSON object keyed by data-parallel rank")
    odd = [k for k in body if not re.fullmatch(r"[0-9]{1,9}", k)]  # str.isdigit would take '²', which int refuses
    if odd:
        raise BadMessage(f"data-parallel rank {odd[0]!r} is not a number")
    ranks = sorted(body, key=int)
    if not ranks:
        return None, "it publishes no KV events"
    config = body[ranks[0]]
    if not isinstance(config, dict) or not isinstance(config.get("endpoint"), str):
        raise BadMessage("a rank's entry has no endpoint")
    if not config.get("enable_kv_cache_events", True) or config.get("publisher", "zmq") != "zmq":
        return None, "it publishes no KV events over ZMQ"
    endpoint = _at_host(config["endpoint"], host)
    replay = config.get("replay_endpoint")
    replay = _at_host(replay, host) if isinstance(replay, str) and replay else None
    for name, value in (("endpoint", endpoint), ("replay_endpoint", replay)):
        if value is not None and not re.match(ZMQ_ENDPOINT, value):
            raise BadMessage(f"{name} {value!r} is not an endpoint the router can connect to (tcp://HOST:PORT)")
    note = "" if len(ranks) == 1 else f"only rank {ranks[0]}'s of {len(ranks)} data-parallel ranks' events are followed"
    return EventSource(endpoint, replay), note


def _at_host(endpoint: str, host: str) -> str:
    """An endpoint as the router reaches it: a wildcard it bound (tcp://*:5557) at the instance's host; a concrete
    one as it is (vLLM reports the address it bound for tcp://*:0)."""
    if not endpoint.startswith("tcp://"):
        return endpoint  # ipc:// and the like: only on the same machine, and given as they are
    where, _, port = endpoint[len("tcp://"):].rpartition(":")
    if where not in _WILDCARD_HOSTS:
        return endpoint
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{port}"
