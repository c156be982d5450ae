"""Last picker of `prefix` and `session`: the first instance in the key's rendezvous order that is routable and
under ConcurrencyThreshold, else the least loaded (the reference router's rule)."""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from warmroute.core import rendezvous
from warmroute.core.decision import AFFINITY, OVERLOAD_SPILL, UNHEALTHY_FALLBACK
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.pipeline import Picker, Request
from warmroute.core.stages.compiled import prefix_hash, top
from warmroute.core.stages.load_guard import least_loaded


def affinity_choice(hash_key: int, fleet: Fleet, threshold: int, model: str | None,
                    up: list[Instance]) -> tuple[Instance, str]:
    """Rendezvous order of `hash_key` over the instances that may serve `model`: its first instance among `up` (the
    candidates: the routable ones, or fewer) under the threshold, else the least loaded of `up`. An instance of the
    order that is not a candidate counts as down."""
    serving = fleet.serving(model) if model is not None else None
    allowed = {i.name for i in up}
    # Usually the first in the order is up and under the threshold: its top alone, without sorting them all.
    first = top(hash_key, list(fleet.instances.values()) if serving is None
                else [fleet.instances[n] for n in sorted(serving)])
    if first is not None and first.name in allowed and first.inflight < threshold:
        return first, AFFINITY
    names = rendezvous.order(hash_key, list(fleet.instances) if serving is None else sorted(serving))
    preferred_up = True
    for pos, name in enumerate(names):
        inst = fleet.instances[name]
        if name not in allowed:
            preferred_up = preferred_up and pos > 0
            continue
        if inst.inflight < threshold:
            if pos == 0:
                return inst, AFFINITY
            return inst, (UNHEALTHY_FALLBACK if not preferred_up else OVERLOAD_SPILL)
    return least_loaded(up), OVERLOAD_SPILL


def prefix_key(prefix_length: int) -> Callable[[Request], int]:
    """The rendezvous key of `prefix`: the first PrefixLength characters."""
    return lambda req: prefix_hash(req.key, prefix_length)


def session_key(prefix_length: int) -> Callable[[Request], int]:
    """The rendezvous key of `session`: the session id (x-session-id or `user`), else as `prefix`."""
    def key(req: Request) -> int:
        session = req.key.session
        return hash_text(session) if session else prefix_hash(req.key, prefix_length)
    return key


def hash_text(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


class Affinity(Picker):
    """Looks at every instance of the fleet, not only the candidates: whether the key's own instance is down or
    left out (unhealthy_fallback) or busy (overload_spill) is part of the answer."""

    name = "affinity"

    def __init__(self, threshold: int, hash_of: Callable[[Request], int]) -> None:
        self.threshold, self.hash_of = threshold, hash_of

    def pick(self, req: Request, candidates: list[Instance]) -> Instance:
        inst, req.picked_reason = affinity_choice(self.hash_of(req), req.fleet, self.threshold, req.key.model,
                                                  candidates)
        return inst

    def explain(self, req: Request, chosen: Instance) -> str | None:
        return req.picked_reason
