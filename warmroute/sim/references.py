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

from warmroute.core.fleet import Fleet
from warmroute.core.prefix_index import PrefixIndex
from warmroute.core.routing_key import RoutingKey
from warmroute.core.strategies import (AFFINITY, CacheAwareStrategy, Decision, OVERLOAD_SPILL, Strategy,
                                       StrategySettings, _least_loaded, _routable)
from warmroute.engine.model import EngineModel


class OracleStrategy(CacheAwareStrategy):
    name = "oracle"
    records_prefixes = False  # it reads the truth, so it keeps no estimate

    def __init__(self, settings: StrategySettings, engines: dict[str, EngineModel]) -> None:
        super().__init__(settings)
        self.engines = engines

    def match_depths(self, blocks: list[int], fleet: Fleet) -> dict[str, int]:
        out = {}
        for name, model in self.engines.items():
            n = model.pool.match(blocks)
            if n:
                out[name] = n
        return out


class SglangLikeStrategy(Strategy):
    name = "sglang_like"
    CACHE_THRESHOLD = 0.3  # smg's --cache-threshold default
    SPILL_RELATIVE = 1.5  # --balance-rel-threshold
    TREE_BLOCKS = 1 << 40  # no capacity: smg's tree is pruned by size and time, far above these runs

    def __init__(self, settings: StrategySettings) -> None:
        super().__init__(settings)
        self.trees = PrefixIndex(self.TREE_BLOCKS)

    def choose(self, key: RoutingKey, fleet: Fleet) -> Decision:
        up = _routable(fleet)
        for inst in up:
            if self.trees.capacity(inst.name) == 0:
                self.trees.add_instance(inst.name, self.TREE_BLOCKS)
        blocks = key.blocks(self.settings.block_bytes)
        depths = self.trees.match_depths(blocks) if blocks else {}
        best = max(up, key=lambda i: depths.get(i.name, 0))  # the first of equal matches, as smg's tree walk
        if depths.get(best.name, 0) * fleet.block_tokens > self.CACHE_THRESHOLD * key.tokens:
            choice, reason = best, AFFINITY
        else:
            choice, reason = min(up, key=lambda i: self.trees.entries(i.name)), AFFINITY
        mean = sum(i.inflight for i in up) / len(up)
        if choice.inflight > mean + max(4.0, 2 * math.sqrt(mean)) and choice.inflight > self.SPILL_RELATIVE * mean:
            choice, reason = _least_loaded(up), OVERLOAD_SPILL
        self.trees.record(choice.name, blocks)
        return Decision(choice.name, reason, 0, key.tokens)
