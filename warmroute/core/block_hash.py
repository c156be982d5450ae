"""Chained block hashes of a routing key.

A key is cut into fixed-size blocks of UTF-8 bytes (64 bytes ≈ 16 tokens at ≈4 bytes per token, the
block size vLLM caches by default). Block k's hash depends on the seed and on every byte of blocks 0..k,
so two keys share the first k hashes exactly when they share the first k blocks: the chain property the
engine's prefix cache has.

Hashing 500 blocks one xxhash call at a time costs ~65 µs in CPython, so the whole chain is computed in
numpy: each 8-byte word is mixed, each block's words are combined with random odd multipliers (content
hash), and the chain is a polynomial over the content hashes computed with one cumulative sum:
    prefix_k = sum_{j<=k} c_j * P^(k-j)  =  P^k * cumsum(c_j * P^-j)       (all mod 2^64)
followed by a bijective finaliser (murmur3's fmix64). Deterministic across processes and machines, so
router replicas, the emulated engine and the simulator all agree on every hash.
"""

from __future__ import annotations

import numpy as np
import xxhash

BLOCK_BYTES_DEFAULT = 64

_M64 = (1 << 64) - 1
_WORD_KEYS = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
     0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x27D4EB2F165667C5, 0x94D049BB133111EB],
    dtype=np.uint64,
)
_P = 0x100000001B3 * 2 + 1 | 1  # odd, so invertible mod 2^64
_P_INV = pow(_P, -1, 1 << 64)
_powers: np.ndarray = np.ones(1, dtype=np.uint64)
_inv_powers: np.ndarray = np.ones(1, dtype=np.uint64)


def _ensure_powers(n: int) -> None:
    """Grow the tables of P^k and P^-k to at least n entries (done rarely, amortised)."""
    global _powers, _inv_powers
    if len(_powers) >= n:
        return
    size = max(n, 2 * len(_powers), 4096)
    p, q = [1] * size, [1] * size
    for k in range(1, size):
        p[k] = p[k - 1] * _P & _M64
        q[k] = q[k - 1] * _P_INV & _M64
    _powers, _inv_powers = np.array(p, dtype=np.uint64), np.array(q, dtype=np.uint64)


_S29, _S33 = np.uint64(29), np.uint64(33)
_WORD_MIX, _F1, _F2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_keys_by_width: dict[int, np.ndarray] = {}


def _word_keys(width: int) -> np.ndarray:
    if width not in _keys_by_width:
        _keys_by_width[width] = np.resize(_WORD_KEYS, width)
    return _keys_by_width[width]


def _fmix64(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> _S33)) * _F1
    x = (x ^ (x >> _S33)) * _F2
    return x ^ (x >> _S33)


def seed_of(*parts: str) -> int:
    """A 64-bit hash seed from the things that must never share a cache (model, LoRA, cache salt)."""
    return xxhash.xxh3_64_intdigest("\x1f".join(parts).encode())


def block_hashes(data: bytes, seed: int = 0, block_bytes: int = BLOCK_BYTES_DEFAULT) -> list[int]:
    """Hashes of the full blocks of `data` (a trailing partial block is not hashed, as in vLLM)."""
    if block_bytes % 8:
        raise ValueError("block_bytes must be a multiple of 8")
    n = len(data) // block_bytes
    if n == 0:
        return []
    _ensure_powers(n + 1)
    # uint64 array arithmetic wraps mod 2^64 silently, which is what we want.
    words = np.frombuffer(data, dtype=np.uint64, count=n * block_bytes // 8)
    words = (words ^ (words >> _S29)) * _WORD_MIX
    content = _fmix64(words.reshape(n, block_bytes // 8) @ _word_keys(block_bytes // 8))
    content[0] ^= np.uint64(seed & _M64)
    prefix = np.cumsum(content * _inv_powers[:n], dtype=np.uint64) * _powers[:n]
    return _fmix64(prefix).tolist()


def text_block_hashes(text: str, seed: int = 0, block_bytes: int = BLOCK_BYTES_DEFAULT) -> list[int]:
    return block_hashes(text.encode("utf-8", "surrogatepass"), seed, block_bytes)
