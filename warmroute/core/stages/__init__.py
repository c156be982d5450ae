"""The stage registry: every filter, scorer and picker a strategy can name, each built from the strategy's settings.

A new scorer is one module here plus one line in SCORERS; cache_aware then runs it where its `scorers` setting
names it (with a weight). Other stages go in STAGES, and a strategy lists them by name (warmroute.core.strategies).
Each entry declares, next to the code that builds the stage, its kind, the settings it reads (its parameters), and
the stages whose facts it reads: a strategy defined in the config is checked against them at start-up.
What each kind of stage is: warmroute/core/pipeline.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from warmroute.core.pipeline import Facts, Filter, Picker, Scorer, Stage
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


@dataclass(frozen=True)
class StageDef:
    """A registered stage: `make(settings, handles)` builds it (None where the settings turn it off, or a list of
    stages); `kind` is its pipeline class (Facts, Filter, Scorer, Picker); `params` the settings it reads, by their
    plain names; `needs` the stages whose facts it reads; `picks`: a picker that can choose (a strategy's last
    stage must), not only narrow."""

    make: Factory
    kind: type[Stage]
    params: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    picks: bool = False

    def __call__(self, settings: Any, handles: Handles) -> Stage | list[Stage] | None:
        return self.make(settings, handles)


# name -> StageDef; each stage's parameters are the `params` of its entry, read by its factory.
STAGES: dict[str, StageDef] = {
    "prefix_match": StageDef(
        lambda s, h: PrefixMatch(s.cache_aware.miss_weight, s.cache_aware.shared_miss_weight,
                                 s.cache_aware.sticky_kv_limit, h.depths),
        Facts, ("miss_weight", "shared_miss_weight", "sticky_kv_limit")),
    "load_guard": StageDef(
        lambda s, h: LoadGuard(s.concurrency_threshold, s.cache_aware.balance_factor, s.cache_aware.balance_slack,
                               h.admission),
        Filter, ("concurrency_threshold", "balance_factor", "balance_slack")),
    "hot_share": StageDef(
        lambda s, h: HotShare(s.cache_aware.hot_balance_factor, s.cache_aware.hot_balance_slack),
        Filter, ("hot_balance_factor", "hot_balance_slack"), needs=("prefix_match",)),
    "slow_start": StageDef(
        lambda s, h: (SlowStart(s.cache_aware.slow_start_window, s.cache_aware.slow_start_aggression,
                                s.cache_aware.slow_start_min_weight)
                      if s.cache_aware.slow_start_window > 0 else None),
        Filter, ("slow_start_window", "slow_start_aggression", "slow_start_min_weight"), needs=("prefix_match",)),
    "scorers": StageDef(  # estimated_ttft reads prefix_match's miss weights
        lambda s, h: [_weighted(n, w, s, h) for n, w in s.cache_aware.scorers.items()],
        Scorer, ("scorers",), needs=("prefix_match",)),
    "slot_wait": StageDef(
        lambda s, h: SlotWait(h.slot_wait, s.cache_aware.saturated_miss_weight, s.cache_aware.copy_only_hot)
        if h.slot_wait is not None else None,
        Scorer, ("saturated_miss_weight", "copy_only_hot"), needs=("prefix_match",)),
    "tie_slack": StageDef(lambda s, h: TieSlack(), Picker, needs=("scorers",)),  # narrows on the scorers' costs
    "least_loaded_ties": StageDef(
        lambda s, h: LeastLoadedTies(s.cache_aware.balance_slack) if s.cache_aware.cold_to_least_loaded else None,
        Picker, ("balance_slack", "cold_to_least_loaded")),
    "rendezvous": StageDef(lambda s, h: RendezvousPick(s.prefix_length), Picker, ("prefix_length",), picks=True),
    "prefix_affinity": StageDef(lambda s, h: Affinity(s.concurrency_threshold, prefix_key(s.prefix_length)),
                                Picker, ("concurrency_threshold", "prefix_length"), picks=True),
    "session_affinity": StageDef(lambda s, h: Affinity(s.concurrency_threshold, session_key(s.prefix_length)),
                                 Picker, ("concurrency_threshold", "prefix_length"), picks=True),
    "least_loaded": StageDef(lambda s, h: LeastLoaded(), Picker, picks=True),
    "round_robin": StageDef(lambda s, h: RoundRobinPick(), Picker, picks=True),
    "random": StageDef(lambda s, h: RandomPick(h.seed), Picker, picks=True),
}
