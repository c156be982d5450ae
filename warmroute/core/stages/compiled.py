"""The primitives of a decision that run compiled where core/_scan.c was built, each with one meaning and a Python
twin used where it was not: the rendezvous top of a tie, the rendezvous seed of an ASCII prompt, the routable filter
(core/fleet.py). No policy lives in C: every rule of a strategy is a stage in Python.
"""

from __future__ import annotations

import os

from warmroute.core import rendezvous
from warmroute.core.fleet import Instance
from warmroute.core.routing_key import RoutingKey

API = 3  # the _scan interface this module calls: a build of another version is not used


try:
    if os.environ.get("WARMROUTE_PURE_PYTHON") == "1":  # to run (and test) the fallback where the C one exists
        raise ImportError("WARMROUTE_PURE_PYTHON=1")
    from warmroute.core import _scan

    if getattr(_scan, "API", 1) != API:
        raise ImportError(f"warmroute.core._scan is built from another version (API {getattr(_scan, 'API', 1)})")
except ImportError:
    _scan = None
if _scan is not None:
    _scan.configure(Instance, rendezvous.hash_fn, rendezvous.name_bytes, rendezvous.encoded,
                    rendezvous.hash_fn_address())


def top_python(seed: int, tied: list[Instance]) -> Instance:
    """The tied instance the seed's rendezvous order puts first (rendezvous.top over their names)."""
    name = rendezvous.top(seed, [i.name for i in tied])
    return next(i for i in tied if i.name == name)


top = _scan.top if _scan is not None else top_python
_text_hash = getattr(_scan, "text_hash", None)  # (a build from before it: every key hashed in Python)


def prefix_hash(key: RoutingKey, prefix_length: int) -> int:
    """key.prefix_hash(prefix_length), the rendezvous seed; an ASCII text's characters hashed in place by _scan
    (the same xxh3 of the same bytes, without copying the prefix twice to get them)."""
    got = _text_hash(key.prefix_units, prefix_length, key.seed) if _text_hash is not None else None
    return key.prefix_hash(prefix_length) if got is None else got
