"""cache_aware's filters, scorer and tie-breaking compiled into one pass over the instances (core/_scan.c).

`compiled_path(pipeline)` returns the fast path for a pipeline of exactly these stages, in this order:
load_guard, slow_start (optional), hot_share | estimated_ttft (weight 1) | tie_slack, least_loaded_ties (optional),
then any last picker; for any other pipeline, or where _scan was not built, None (the pipeline runs stage by
stage). The scan does not model slow start: while an instance ramps, the decision runs stage by stage. The
compiled pass takes one `ScanParams` and computes the same floating-point operations in the same order as the
stages do, so both decide alike (tests/core/test_choose_equivalence.py checks it on random fleets).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Literal, NamedTuple

from warmroute.core import rendezvous
from warmroute.core.fleet import Instance
from warmroute.core.routing_key import RoutingKey

if TYPE_CHECKING:
    from warmroute.core.pipeline import FastPath, Pipeline, Request

API = 2  # the _scan interface this module calls: a build of another version is not used


class ScanParams(NamedTuple):
    threshold: int  # load_guard: ConcurrencyThreshold
    balance_factor: float  # load_guard: ε
    balance_slack: int  # load_guard: requests over (1+ε) x the mean
    hot: bool  # hot_share: the prefix is hot (else the filter keeps every candidate)
    hot_factor: float  # hot_share: δ
    hot_slack: float  # hot_share: its slack, in units of Instance.recent
    miss: dict[str, float]  # estimated_ttft: α x uncached tokens per instance holding part of the prompt
    miss_all: float  # estimated_ttft: the same anywhere else
    prompt: float  # estimated_ttft: the prompt's tokens (for the engine's KV backlog)
    mean: float  # estimated_ttft: the fleet's mean uncached prompt (for other routers' waiting requests)
    slack_tokens: float  # tie_slack: α x one block
    least_slack: float  # least_loaded_ties: requests over the least loaded (inf: the step is not there)


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


def compiled_path(pipeline: Pipeline) -> FastPath | None:
    from warmroute.core.stages.estimated_ttft import EstimatedTtft
    from warmroute.core.stages.hot_share import HotShare
    from warmroute.core.stages.least_loaded import LeastLoadedTies
    from warmroute.core.stages.load_guard import LoadGuard
    from warmroute.core.stages.slow_start import SlowStart
    from warmroute.core.stages.tie_slack import TieSlack

    f, s, p = pipeline.filters, pipeline.scorers, pipeline.pickers[:-1]
    if (_scan is None or [type(x) for x in f] not in ([LoadGuard, HotShare], [LoadGuard, SlowStart, HotShare])
            or [type(x) for x in s] != [EstimatedTtft] or s[0].weight != 1.0
            or [type(x) for x in p] not in ([TieSlack], [TieSlack, LeastLoadedTies])):
        return None
    guard, hot = f[0], f[-1]
    least_slack = p[1].slack if len(p) == 2 else math.inf
    scan, new = _scan.scan, tuple.__new__  # (new: a NamedTuple without the call to its __new__)

    def fast(req: Request) -> Instance | list[Instance] | None | Literal[False]:
        if req.ramp_caps:  # an instance is ramping (slow_start prepared its caps): the stages decide
            return False
        is_hot = req.hot
        return scan(req.up, new(ScanParams, (
            guard.threshold, guard.factor, guard.slack, is_hot, hot.factor,
            hot.slack * req.fleet.recent_unit.value if is_hot else 0.0,  # HotShare.slack_recent
            req.miss, req.miss_all, req.prompt, req.fleet.mean_uncached_tokens, req.alpha * req.block_tokens,
            least_slack)))

    return fast
