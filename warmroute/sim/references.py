"""Reference points no router can beat, for the simulator only.

  oracle  cache_aware's rule fed with the truth: every instance's real cache contents (from its engine
          model) instead of the router's estimate. Same load guard, same tie-breaking.
  pooled  one instance with the whole fleet's cache and compute (built by `Simulation(pooled=True)`): no
          routing can share a cache better than having one cache.
"""

from __future__ import annotations

from warmroute.core.fleet import Fleet
from warmroute.core.strategies import CacheAwareStrategy, StrategySettings
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
            n = model.cache.match(blocks)
            if n:
                out[name] = n
        return out
