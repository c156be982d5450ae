"""Rendezvous (highest-random-weight) hashing: a stable, per-key order of instances.

Every key ranks every instance by a pseudo-random weight of (key, instance name). Adding an instance moves
only the keys it now wins (about 1/(N+1) of them); removing one moves only the keys it held. Every router
replica computes the same order with no shared state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat

import xxhash

_M64 = (1 << 64) - 1
# The weight of (key, name) is hash_fn(encoded(name), key); core/_scan.c computes it with these same three.
hash_fn = xxhash.xxh3_64_intdigest
name_bytes: dict[str, bytes] = {}  # encoded names, cached


def hash_fn_address() -> int:
    """Where hash_fn's C function (the xxhash library's XXH3_64bits_withSeed, inside the xxhash package's
    extension) is, for core/_scan.c to call it without the Python wrapper; 0 where it is not exported."""
    try:
        import ctypes

        from xxhash import _xxhash

        return ctypes.cast(ctypes.CDLL(_xxhash.__file__).XXH3_64bits_withSeed, ctypes.c_void_p).value or 0
    except (ImportError, OSError, AttributeError):
        return 0


def encoded(name: str) -> bytes:
    b = name_bytes.get(name)
    if b is None:
        b = name_bytes[name] = name.encode("utf-8", "surrogatepass")
    return b


def weight(key: int, name: str) -> int:
    """The (key, instance) weight: xxh3 of the name, seeded by the key (one C call)."""
    return hash_fn(encoded(name), key & _M64)


def _weights(key: int, names: Sequence[str]) -> list[int]:
    """weight(key, n) for every name, looped in C (map) rather than in Python, which is several times faster."""
    try:
        raw = list(map(name_bytes.__getitem__, names))
    except KeyError:  # a name not seen before
        raw = [encoded(n) for n in names]
    return list(map(hash_fn, raw, repeat(key & _M64)))


def top(key: int, names: Iterable[str]) -> str | None:
    """The instance this key prefers (None if there are none); the first of equal weights, as max() picks."""
    names = names if isinstance(names, (list, tuple)) else list(names)
    if not names:
        return None
    w = _weights(key, names)
    return names[w.index(max(w))]


def order(key: int, names: Iterable[str]) -> list[str]:
    """All instances, most preferred first (a stable sort: equal weights keep their given order)."""
    names = names if isinstance(names, (list, tuple)) else list(names)
    w = _weights(key, names)
    return [names[k] for k in sorted(range(len(names)), key=w.__getitem__, reverse=True)]
