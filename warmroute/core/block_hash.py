"""Chained block hashes of a routing key.

A key is cut into fixed-size blocks of UTF-8 bytes (64 bytes ≈ 16 tokens at ≈4 bytes per token, the
block size vLLM caches by default). Block k's hash depends on the seed and on every byte of blocks 0..k,
so two keys share the first k hashes exactly when they share the first k blocks: the chain property the
engine's prefix cache has.

Hashing a long prompt's blocks one xxhash call at a time is slow in CPython, so the whole chain is computed in
numpy, in as few array operations as possible (each has a fixed call overhead; timings in docs/tuning.md):
  * every 8-byte word gets a xorshift (x ^ x >> 29, so a flipped top bit also changes a low bit; a purely
    linear hash lets two top-bit flips cancel), and each block's words are combined with odd per-lane
    multipliers (one dot product per block): the block's content sum c_j;
  * murmur3's fmix64 finaliser on every c_j, so the chain below is not linear in the bytes across blocks;
  * the chain: h_k = sum_{j<=k} fmix(c_j) * W_j (mod 2^64) with W_j = P^-j, one cumulative sum.
h_k is P^-k times the polynomial hash sum_{j<=k} fmix(c_j) * P^(k-j): at a given position k two keys collide
exactly when those polynomials do. No finaliser on h_k: a bijection cannot remove a collision, and h_k
is already a sum of fmix outputs times odd constants, so all its bits are evenly spread (they are dict keys).
Deterministic across processes and machines, so router replicas, the emulated engine and the simulator
all agree on every hash.

The same construction is also compiled (`_blockhash.c`, built by `pip install` where a C compiler is found):
one loop over the words instead of ten array passes (docs/tuning.md), returned as
a Chain (the hashes as uint64 words; ints made only where Python reads one). Both take a str too, hashing its
UTF-8 bytes (the C one reads an ASCII str's characters in place). A Chain of a bytes or str key is lazy: it
hashes when first read, and only as far as read, so a cold prompt (nobody holds its first block) is hashed past
its first block only when the router records it, after the request has been sent. `block_hashes` uses it when
it was built; the numpy version below is the fallback and the reference the tests compare it with
(tests/core/test_block_hash.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import xxhash

BLOCK_BYTES_DEFAULT = 64
API = 2  # the _blockhash interface this module calls (2: it hashes a str as its UTF-8 bytes)

_M64 = (1 << 64) - 1
_P = 0x100000001B3 * 2 + 1 | 1  # odd, so invertible mod 2^64
_P_INV = pow(_P, -1, 1 << 64)
# Odd per-lane multipliers (random 64-bit constants times the word mixer 0xBF58476D1CE4E5B9; uint64 wraps).
_LANE_KEYS = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
     0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x27D4EB2F165667C5, 0x94D049BB133111EB],
    dtype=np.uint64,
) * np.uint64(0xBF58476D1CE4E5B9)
_S29, _S33 = np.uint64(29), np.uint64(33)
_F1, _F2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_weights: np.ndarray = np.ones(1, dtype=np.uint64)  # W_j = P^-j
_keys_by_width: dict[int, np.ndarray] = {}
# A dot product per row: np.vecdot (numpy >= 2) is a little cheaper than matmul on uint64.
_rowdot = getattr(np, "vecdot", np.matmul)


def _ensure_weights(n: int) -> None:
    """Grow the table of chain weights to at least n entries (done rarely, amortised)."""
    global _weights
    if len(_weights) >= n:
        return
    size = max(n, 2 * len(_weights), 4096)
    w = [1] * size
    for k in range(1, size):
        w[k] = w[k - 1] * _P_INV & _M64
    _weights = np.array(w, dtype=np.uint64)


def _lane_keys(width: int) -> np.ndarray:
    keys = _keys_by_width.get(width)
    if keys is None:
        keys = _keys_by_width[width] = np.resize(_LANE_KEYS, width)
    return keys


def _fmix64_inplace(x: np.ndarray) -> None:
    x ^= x >> _S33
    x *= _F1
    x ^= x >> _S33
    x *= _F2
    x ^= x >> _S33


def seed_of(*parts: str) -> int:
    """A 64-bit hash seed from the things that must never share a cache (model, LoRA, cache salt)."""
    return xxhash.xxh3_64_intdigest("\x1f".join(parts).encode())


def numpy_block_hashes(data: bytes | str, seed: int = 0, block_bytes: int = BLOCK_BYTES_DEFAULT) -> list[int]:
    """Hashes of the full blocks of `data` (a str: its UTF-8 bytes; a trailing partial block is not hashed, as in
    vLLM), in numpy."""
    if block_bytes <= 0 or block_bytes % 8:
        raise ValueError("block_bytes must be a positive multiple of 8")
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    n = len(data) // block_bytes
    if n == 0:
        return []
    _ensure_weights(n)
    width = block_bytes // 8
    # uint64 array arithmetic wraps mod 2^64 silently, which is what we want. In-place steps on the
    # temporaries save allocations; nothing is shared between calls, so this is thread-safe.
    words = np.frombuffer(data, dtype=np.uint64, count=n * width)
    x = words >> _S29
    x ^= words
    content = _rowdot(x.reshape(n, width), _lane_keys(width))
    _fmix64_inplace(content)
    content[0] ^= np.uint64(seed & _M64)
    content *= _weights[:n]
    return np.add.accumulate(content, out=content).tolist()


try:
    if os.environ.get("WARMROUTE_PURE_PYTHON") == "1":  # to run (and test) the fallback where the C one exists
        raise ImportError("WARMROUTE_PURE_PYTHON=1")
    from warmroute.core import _blockhash

    if getattr(_blockhash, "API", 1) != API:  # an older build cannot hash a str: numpy until it is rebuilt
        raise ImportError(f"warmroute.core._blockhash is of another version (API {getattr(_blockhash, 'API', 1)})")
except ImportError:  # not compiled here (no C compiler at install time): numpy it is
    _blockhash = None
    block_hashes = numpy_block_hashes
else:
    _blockhash.configure(_LANE_KEYS.tolist(), _P_INV, BLOCK_BYTES_DEFAULT)
    block_hashes = _blockhash.block_hashes
NATIVE = _blockhash is not None  # whether the compiled version is in use (logged at start-up)


def text_block_hashes(text: str, seed: int = 0, block_bytes: int = BLOCK_BYTES_DEFAULT) -> Sequence[int]:
    return block_hashes(text, seed, block_bytes)


def extend_chain(parent: int, depth: int, data: bytes, block_bytes: int) -> list[int]:
    """The chain of `data`'s full blocks continuing a chain whose block `depth - 1` hashed to `parent` (depth 0:
    a chain from the start, seeded by `parent`). The chain is a weighted sum, h_{d+i} = h_{d-1} + W_d x g_i with g
    the chain of the new blocks alone from seed 0, so a block reported on its own (a KV event naming only its
    parent) hashes exactly as it would have inside the whole prompt."""
    if depth == 0:
        return list(block_hashes(data, parent, block_bytes))
    weight = pow(_P_INV, depth, 1 << 64)
    return [(parent + weight * g) & _M64 for g in block_hashes(data, 0, block_bytes)]
