"""Rendezvous (highest-random-weight) hashing: a stable, per-key order of instances.

Every key ranks every instance by a pseudo-random weight of (key, instance name). Adding an instance moves
only the keys it now wins (about 1/(N+1) of them); removing one moves only the keys it held. Every router
replica computes the same order with no shared state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import xxhash

_M64 = (1 << 64) - 1
_hash = xxhash.xxh3_64_intdigest
_name_bytes: dict[str, bytes] = {}


def weight(key: int, name: str) -> int:
    """The (key, instance) weight: xxh3 of the name, seeded by the key (one C call)."""
    b = _name_bytes.get(name)
    if b is None:
        b = _name_bytes[name] = name.encode("utf-8", "surrogatepass")
    return _hash(b, key & _M64)


def top(key: int, names: Iterable[str]) -> str | None:
    """The instance this key prefers (None if there are none)."""
    return max(names, key=lambda n: weight(key, n), default=None)


def order(key: int, names: Sequence[str]) -> list[str]:
    """All instances, most preferred first."""
    return sorted(names, key=lambda n: weight(key, n), reverse=True)
