"""Reference points no router can beat, for the simulator only.

  oracle  cache_aware's rule fed with the truth: every instance's real cache contents (from its engine
          model) instead of the router's estimate. Same load guard, same tie-breaking.
  pooled  one instance with the whole fleet's cache and compute (built by `Simulation(pooled=True)`): no
          routing can share a cache better than having one cache.

And one peer, so the simulator can reproduce what the HTTP comparison with it shows (docs/peers.md):

  sglang_like  an approximation of SGLang Model Gateway's `cache_aware` policy at its defaults, from its
          documentation (`smg launch --help`): a prefix tree per worker with no capacity model; a request whose
          longest match covers more than 30% of it goes to that worker, otherwise to the worker with the
          smallest tree; the chosen worker is skipped for the least loaded when its in-flight count exceeds
          the mean by max(4, 2 x sqrt(mean)) and 1.5 x the mean. Not smg's code: its tree is per character,
          ours per 64-byte block, and it has no feedback or load signals here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from warmroute.core.decision import AFFINITY, OVERLOAD_SPILL
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.pipeline import Picker, Pipeline, Request
from warmroute.core.prefix_index import PrefixIndex
from warmroute.core.stages import Handles
from warmroute.core.stages.load_guard import least_loaded
from warmroute.core.stages.prefix_match import DepthSource
from warmroute.core.strategies import CACHE_AWARE, Strategy, StrategySettings, StrategySpec
from warmroute.engine.model import EngineModel


def engine_depths(engines: dict[str, EngineModel]) -> DepthSource:
    """The oracle's depth source: what each engine really holds."""
    def depths(blocks: Sequence[int], fleet: Fleet) -> dict[str, int]:
        out = {}
        for name, model in engines.items():
            n = model.pool.match(blocks)
            if n:
                out[name] = n
        return out
    return depths


ORACLE = StrategySpec(CACHE_AWARE.stages, CACHE_AWARE.cls, records_prefixes=False)  # it reads the truth


def oracle(settings: StrategySettings, engines: dict[str, EngineModel],
           slot_wait: Callable[[Instance], float] | None = None) -> Strategy:
    return ORACLE.build("oracle", settings, Handles(depths=engine_depths(engines), slot_wait=slot_wait))


class SglangLikePick(Picker):
    name = "sglang_like"
    CACHE_THRESHOLD = 0.3  # smg's --cache-threshold default
    SPILL_RELATIVE = 1.5  # --balance-rel-threshold
    TREE_BLOCKS = 1 << 40  # no capacity: smg's tree is pruned by size and time, far above these runs

    def __init__(self) -> None:
        self.trees = PrefixIndex(self.TREE_BLOCKS)

    def pick(self, req: Request, candidates: list[Instance]) -> Instance:
        up, key, fleet = candidates, req.key, req.fleet
        for inst in up:
            if self.trees.capacity(inst.name) == 0:
                self.trees.add_instance(inst.name, self.TREE_BLOCKS)
        blocks = key.blocks(fleet.settings.block_bytes)
        depths = self.trees.match_depths(blocks) if blocks else {}
        best = max(up, key=lambda i: depths.get(i.name, 0))  # the first of equal matches, as smg's tree walk
        if depths.get(best.name, 0) * fleet.block_tokens > self.CACHE_THRESHOLD * key.tokens:
            choice, reason = best, AFFINITY
        else:
            choice, reason = min(up, key=lambda i: self.trees.entries(i.name)), AFFINITY
        mean = sum(i.inflight for i in up) / len(up)
        if choice.inflight > mean + max(4.0, 2 * math.sqrt(mean)) and choice.inflight > self.SPILL_RELATIVE * mean:
            choice, reason = least_loaded(up), OVERLOAD_SPILL
        self.trees.record(choice.name, blocks)
        req.picked_reason = reason
        return choice

    def explain(self, req: Request, chosen: Instance) -> str | None:
        return req.picked_reason


def sglang_like(settings: StrategySettings) -> Strategy:
    return Strategy("sglang_like", settings, Pipeline(pickers=[SglangLikePick()]))
