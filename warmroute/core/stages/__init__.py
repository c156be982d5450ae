"""The stage registry: every filter, scorer and picker a strategy can name, each built from the strategy's settings.

A new scorer is one module here plus one line in SCORERS; cache_aware then runs it where its `scorers` setting
names it (with a weight). Other stages go in STAGES, and a strategy lists them by name (warmroute.core.strategies).
What each kind of stage is: warmroute/core/pipeline.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from warmroute.core.pipeline import Stage
from warmroute.core.fleet import Instance
from warmroute.core.stages.affinity import Affinity, prefix_key, session_key
from warmroute.core.stages.baselines import RandomPick, RoundRobinPick
from warmroute.core.stages.estimated_ttft import EstimatedTtft
from warmroute.core.stages.hot_share import HotShare
from warmroute.core.stages.least_loaded import LeastLoaded, LeastLoadedTies
from warmroute.core.stages.load_guard import LoadGuard
from warmroute.core.stages.prefix_match import DepthSource, PrefixMatch, index_depths
from warmroute.core.stages.rendezvous_pick import RendezvousPick
from warmroute.core.stages.slot_wait import SlotWait
from warmroute.core.stages.slow_start import SlowStart
from warmroute.core.stages.tie_slack import TieSlack


@dataclass
class Handles:
    """What a stage may need beyond settings: a seed for random choices, where cached depths come from (the
    router's index; the simulator's oracle passes the engines' real caches), and with an admission queue
    (core/admission/), how long a request would wait there for a slot at each instance."""

    seed: int | None = None
    depths: DepthSource = index_depths
    slot_wait: Callable[[Instance], float] | None = None  # None: no admission queue

    @property
    def admission(self) -> bool:
        return self.slot_wait is not None


Factory = Callable[[Any, Handles], "Stage | list[Stage] | None"]

# name -> factory(settings, handles); `settings` is a StrategySettings (warmroute.core.strategies).
SCORERS: dict[str, Factory] = {
    "estimated_ttft": lambda s, h: EstimatedTtft(),
}


def _weighted(name: str, weight: float, s: Any, h: Handles) -> Stage:
    scorer = SCORERS[name](s, h)
    scorer.weight = weight
    return scorer


# As SCORERS; a factory may return None where the settings turn its stage off, or several stages.
STAGES: dict[str, Factory] = {
    "prefix_match": lambda s, h: PrefixMatch(s.cache_aware.miss_weight, s.cache_aware.shared_miss_weight,
                                             s.cache_aware.sticky_kv_limit, h.depths),
    "load_guard": lambda s, h: LoadGuard(s.concurrency_threshold, s.cache_aware.balance_factor,
                                         s.cache_aware.balance_slack, h.admission),
    "hot_share": lambda s, h: HotShare(s.cache_aware.hot_balance_factor, s.cache_aware.hot_balance_slack),
    "slow_start": lambda s, h: (SlowStart(s.cache_aware.slow_start_window, s.cache_aware.slow_start_aggression,
                                          s.cache_aware.slow_start_min_weight)
                                if s.cache_aware.slow_start_window > 0 else None),
    "scorers": lambda s, h: [_weighted(n, w, s, h) for n, w in s.cache_aware.scorers.items()],
    "slot_wait": lambda s, h: SlotWait(h.slot_wait) if h.slot_wait is not None else None,
    "tie_slack": lambda s, h: TieSlack(),
    "least_loaded_ties": lambda s, h: (LeastLoadedTies(s.cache_aware.balance_slack)
                                       if s.cache_aware.cold_to_least_loaded else None),
    "rendezvous": lambda s, h: RendezvousPick(s.prefix_length),
    "prefix_affinity": lambda s, h: Affinity(s.concurrency_threshold, prefix_key(s.prefix_length)),
    "session_affinity": lambda s, h: Affinity(s.concurrency_threshold, session_key(s.prefix_length)),
    "least_loaded": lambda s, h: LeastLoaded(),
    "round_robin": lambda s, h: RoundRobinPick(),
    "random": lambda s, h: RandomPick(h.seed),
}
