"""The emulated engine's prefix-cache block hashes, computed the way vLLM V1 computes them.

A prompt's token ids are cut into full blocks of `block_size` tokens (a partial last block is never cached).
Block i's hash is SHA-256 over (block i-1's digest, or NONE_HASH for the first block; block i's token ids;
its extra keys: the LoRA adapter's name on every block, the request's `cache_salt` on the first block only),
so a block's hash names its whole prefix, and two prompts share a cached block only if they share every
token before it and the same salt. vLLM hashes a pickled or CBOR-encoded tuple; here the tuple is written as
canonical bytes (parent digest, token count and token ids as little-endian uint32, extra keys as JSON), which
gives the same chain structure with an encoding any language can reproduce.

vLLM's KV-cache events publish a block hash as an unsigned 64-bit int: `low64` gives that value.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Sequence

NONE_HASH = hashlib.sha256(b"warmroute-engine/none-hash").digest()  # the first block's parent
_COUNT = struct.Struct("<I")


def block_hashes(token_ids: Sequence[int], block_size: int, *, lora_name: str | None = None,
                 cache_salt: str | None = None) -> list[bytes]:
    """The chained SHA-256 digests of the prompt's full blocks, first block first."""
    if block_size < 1:
        raise ValueError("block size must be at least 1 token")
    packed = array("I", token_ids)  # OverflowError for an id outside 0..2**32-1
    if sys.byteorder == "big":
        packed.byteswap()
    data = packed.tobytes()
    step = block_size * packed.itemsize
    count = _COUNT.pack(block_size)
    every = _extra((lora_name,) if lora_name else ())
    first = _extra(tuple(k for k in (lora_name, cache_salt) if k))
    digests: list[bytes] = []
    parent = NONE_HASH
    for i in range(len(token_ids) // block_size):
        extra = first if i == 0 else every
        parent = hashlib.sha256(parent + count + data[i * step:(i + 1) * step] + extra).digest()
        digests.append(parent)
    return digests


def low64(digest: bytes) -> int:
    """The 64-bit unsigned int vLLM publishes for a block hash (its last 8 bytes, big-endian)."""
    return int.from_bytes(digest[-8:], "big")


def _extra(keys: tuple[str, ...]) -> bytes:
    return json.dumps(keys, separators=(",", ":")).encode() if keys else b""
