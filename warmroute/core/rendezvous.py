"""Rendezvous (highest-random-weight) hashing: a stable, per-key order of instances.

Every key ranks every instance by a pseudo-random weight of (key, instance name). Adding an instance moves
only the keys it now wins (about 1/(N+1) of them); removing one moves only the keys it held. Every router
replica computes the same order with no shared state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import xxhash

_M64 = (1 << 64) - 1
_name_hashes: dict[str, int] = {}


def _name_hash(name: str) -> int:
    h = _name_hashes.get(name)
    if h is None:
        h = _name_hashes[name] = xxhash.xxh3_64_intdigest(name.encode())
    return h


def weight(key: int, name: str) -> int:
    """The (key, instance) weight: a 64-bit mix of both (splitmix64 finaliser)."""
    x = (key ^ _name_hash(name)) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def top(key: int, names: Iterable[str]) -> str | None:
    """The instance this key prefers (None if there are none)."""
    return max(names, key=lambda n: weight(key, n), default=None)


def order(key: int, names: Sequence[str]) -> list[str]:
    """All instances, most preferred first."""
    return sorted(names, key=lambda n: weight(key, n), reverse=True)
