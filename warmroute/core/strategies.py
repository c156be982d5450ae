"""Routing strategies: given a routing key and the fleet, choose an instance. This is where decisions are made.

Every strategy is a pipeline of named stages (warmroute/core/pipeline.py; the stages: warmroute/core/stages/),
doing no I/O, so the HTTP router and the simulator make exactly the same decision for the same state.

  cache_aware  (default) lowest estimated time to first token, from the prefix index and queued prefill,
               under a bounded-load guard; ties and cold prefixes placed by rendezvous on the prefix. A
               conversation kept on its instance may wait in the router while that instance is full
               (core/admission/ decides; the shells, router/routing.py and sim/simulator.py, wait).
  prefix       the reference's behaviour: rendezvous on the first PrefixLength characters, spilling along
               that prefix's own rendezvous order past ConcurrencyThreshold.
  session      rendezvous on the session id (x-session-id header or `user` field).
  least_loaded, round_robin, random   the baselines.

Each strategy's own knobs are a settings model nested in StrategySettings (`cache_aware`), which the router's
and the simulator's settings both carry; STRATEGIES builds a strategy from them by name. A strategy is a profile
(StrategySpec): its stages, whose parameters are declared with each stage (core/stages/__init__.py). The built-in
strategies are such profiles; the config may define more (StrategyProfile, `strategies:` in the router's YAML),
checked at start-up (stages_problem).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from warmroute.core.decision import (AFFINITY, APPROXIMATE, CACHE_HIT, COLD, HOT_SPREAD, KV_SPILL, LOAD_BALANCE,
                                     OVERLOAD_SPILL, PRECISE, REASONS, UNHEALTHY_FALLBACK, Decision, ModelNotServed,
                                     NoInstanceAvailable)
from warmroute.core.exact_index import ExactIndex
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.pipeline import Facts, Filter, Picker, Pipeline, Request, Scorer, Stage
from warmroute.core.popularity import Popularity
from warmroute.core.routing_key import RoutingKey
from warmroute.core.settings_model import SettingsModel
from warmroute.core.stages import SCORERS, STAGES, Handles
from warmroute.core.stages.compiled import _scan
from warmroute.core.stages.prefix_match import PRIVATE, SHARED, SWAMPED, kv_pressure
from warmroute.core.stages.routable import routable

__all__ = ["AFFINITY", "APPROXIMATE", "PRECISE", "CACHE_HIT", "COLD", "HOT_SPREAD", "KV_SPILL", "LOAD_BALANCE", "OVERLOAD_SPILL", "REASONS",
           "UNHEALTHY_FALLBACK", "Decision", "ModelNotServed", "NoInstanceAvailable", "PRIVATE", "SHARED", "SWAMPED",
           "kv_pressure", "_scan", "CacheAwareSettings", "StrategySettings", "Strategy", "CacheAwareStrategy",
           "STRATEGIES", "StrategySpec", "StrategyProfile", "CACHE_AWARE", "make_strategy", "stages_problem",
           "check_profiles", "settings_for", "strategy_names", "ADMISSION_PARAMS", "Handles", "merge_layers",
           "nest_flat_names", "own_setting", "OWN_SETTINGS", "FLAT_ALIASES", "AdmissionConfig", "flat_name",
           "flat_names", "former_names"]


class CacheAwareSettings(SettingsModel):
    """cache_aware's own knobs (the why of each default: docs/tuning.md)."""

    balance_factor: float = Field(1.0, ge=0.0, le=10.0)
    """cache_aware's bounded-load factor epsilon: no instance above (1+epsilon) x mean in-flight + balance_slack."""
    balance_slack: int = Field(4, ge=0, le=1024)
    """Requests in flight an instance may have over (1+epsilon) x the mean; also how close to the least loaded a tied
    instance must be to take a cold prefix."""
    hot_balance_factor: float = Field(0.2, ge=0.0, le=1000.0)
    """cache_aware's guard for hot prefixes, delta: a prefix on at least 1/N of the recent requests (N instances) skips
    the instances sent more than (1+delta) x the mean of recent requests + hot_balance_slack, so it is copied to more
    instances instead of loading a few. 1000: off."""
    hot_balance_slack: float = Field(4.0, ge=0.0, le=1000.0)
    """Recent requests over (1+delta) x the mean, for hot_balance_factor."""
    cold_to_least_loaded: bool = True
    """Among instances that tie on cost (a cold prefix), keep only those within balance_slack requests of the least
    loaded before the rendezvous order picks."""
    miss_weight: float = Field(16.0, ge=0.0, le=1000.0)
    """cache_aware's cost of an uncached prompt token, relative to a queued one, when one instance holds the prompt's
    deepest cached prefix (a conversation, a document): higher keeps such prompts on their instance longer."""
    shared_miss_weight: float = Field(1.0, ge=0.0, le=1000.0)
    """The same when several instances hold it (a popular prefix) or none: lower copies a popular prefix to more
    instances sooner."""
    saturated_miss_weight: float = Field(16.0, ge=0.0, le=1000.0)
    """The weight of every uncached token while each instance that may take the request is full and it will wait in
    the router wherever it goes (the admission queue's slot_wait): a shorter line there only moves the wait onto the
    requests behind, while a prefix computed again elsewhere is compute the whole fleet lacks. Applies in place of
    shared_miss_weight (when that is above 0), not to a prompt whose one holder is swamped (sticky_kv_limit); 0: as the
    prefix match weighed it."""
    copy_only_hot: bool = False
    """With the admission queue on: a prompt whose prefix several instances hold weighs its miss at
    saturated_miss_weight, full or not, unless that prefix is hot (hot_balance_factor's 1/N of the recent requests):
    another copy of a prefix that is not spreads no load that needed spreading. Off by default: it wins the 2x surge
    over HTTP, but costs multi-turn chat hit rate and throughput (docs/tuning.md)."""
    sticky_kv_limit: float = Field(3.0, ge=0.0, le=1000.0)
    """cache_aware keeps a prompt on the one instance holding its prefix (miss_weight) only while the prompts in flight
    there need at most this many times its KV cache (as engine feedback scales it); beyond, the engine evicts queued
    histories anyway, and the prompt weighs its miss like a shared one. 1000: always sticky."""
    hold_kv_limit: float = Field(1000.0, ge=0.0, le=1000.0)
    """cache_aware holds such a prompt in the router while the prompts in flight at its instance, with it, would need
    more than this many times its KV cache (there the engine would evict its history while it queues), and looks again
    whenever a request finishes (see hold_keep). 1000 (the default): never holds on KV demand, only at the concurrency
    threshold (why: docs/tuning.md)."""
    hold_keep: float = Field(1.5, ge=0.0, le=1000.0)
    """A held request keeps the instance first chosen for it until it has waited this many times the fleet's mean time
    to first token; then it is decided again (and may go elsewhere) whenever a request finishes. 0: decided again every
    time."""
    hold_timeout: float = Field(5.0, ge=0.0, le=3600)
    """Seconds a request waiting on hold_kv_limit waits for its own instance with that limit applied; then its own
    instance, or any other, takes it as soon as it has a free slot."""
    slow_start_window: float = Field(30.0, ge=0.0, le=3600.0)
    """Seconds over which an instance that joins the fleet (or comes back healthy) ramps up to its full share of
    requests, as Envoy's slow start; hot prefixes are copied to it first. 0: off (a new instance takes its full share at
    once). Instances present when the router starts do not ramp."""
    slow_start_aggression: float = Field(1.0, ge=0.05, le=100.0)
    """Shape of the slow-start ramp: the share grows as (elapsed / window) ** (1 / aggression); 1 is linear, above 1
    faster at first."""
    slow_start_min_weight: float = Field(0.1, ge=0.0, le=1.0)
    """The share of a full instance's requests a ramping instance may take from its first second."""
    scorers: dict[str, float] = Field(
        default_factory=lambda: {"estimated_ttft": 1.0},
        description="The scorers that cost each instance, with their weights (NAME=WEIGHT,...; in YAML a "
                    "mapping); their costs are added. Registered: " + ", ".join(SCORERS) + ".")

    @field_validator("scorers", mode="before")
    @classmethod
    def _parse_scorers(cls, v: Any) -> Any:
        """'estimated_ttft=1,other=0.5' (a flag or variable) as a mapping; a bare name weighs 1."""
        if not isinstance(v, str):
            return v
        out = {}
        for part in (p.strip() for p in v.split(",")):
            name, sep, weight = part.partition("=")
            out[name.strip()] = weight.strip() if sep else 1.0
        return out

    @field_validator("scorers")
    @classmethod
    def _known_scorers(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = [n for n in v if n not in SCORERS]
        if unknown or not v:
            raise ValueError(f"unknown scorer {unknown[0]!r}" if unknown else "at least one scorer is needed")
        if any(not (0.0 <= w <= 1000.0) for w in v.values()):
            raise ValueError("weights must be from 0 to 1000")
        return v


# Settings models nested in StrategySettings, whose knobs may also be named alone (flags, variables, older YAML):
# each strategy's own (cache_aware), and the admission queue's (core/admission/settings.py AdmissionConfig, added at
# the end of this module, which it imports). The field of StrategySettings that holds them -> the model.
OWN_SETTINGS: dict[str, type[BaseModel]] = {"cache_aware": CacheAwareSettings}
# Other names a nested setting is still accepted under (former names): name -> (field, its name in the model).
# Filled with the admission model (ADMISSION_ALIASES); `admission: false` is its `enabled`.
FLAT_ALIASES: dict[str, tuple[str, str]] = {}


class StrategySettings(SettingsModel):
    """What every strategy is built from: the reference's two numbers, and each strategy's own settings. A
    strategy's own setting may also be given at the top level by its name alone (`balance_factor`), as flags,
    environment variables and older YAML files name them."""

    prefix_length: int = Field(4096, ge=1024, le=65536)
    """PrefixLength: characters of message text (OpenAI routes) or bytes of body (/invocations) that identify a
    prefix."""
    concurrency_threshold: int = Field(64, ge=1, le=1024)
    """ConcurrencyThreshold: most in-flight requests the prefix-selected instance may have before a request goes to
    the instance with room that the strategy ranks next. Set it above the load per instance you expect at peak: a
    fleet loaded to about the threshold everywhere spills back and forth, and each spill recomputes a prefix. It
    never caps an engine's batch (engine_capacity does, where an engine is full)."""
    cache_aware: CacheAwareSettings = Field(default_factory=CacheAwareSettings)
    """cache_aware's own settings."""
    admission: AdmissionConfig = Field(default_factory=lambda: AdmissionConfig())
    """The admission queue's settings (`admission: {timeout_s: 30}`; `admission: false` turns it off)."""

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_names(cls, data: Any) -> Any:
        return nest_flat_names(data)

    def strategy_settings(self) -> StrategySettings:
        """Only the strategy settings (of a model that extends this one, like the router's)."""
        if type(self) is StrategySettings:
            return self
        return StrategySettings(**{n: getattr(self, n) for n in StrategySettings.model_fields})


def nest_flat_names(data: Any) -> Any:
    """{'balance_factor': 2} -> {'cache_aware': {'balance_factor': 2}}: a nested setting named alone (or by a
    former name: {'queue_timeout': 9} -> {'admission': {'timeout_s': 9}}; {'admission': False} -> {'admission':
    {'enabled': False}})."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for field in OWN_SETTINGS:
        if isinstance(out.get(field), str) and out[field].lstrip().startswith("{"):  # JSON, from a variable
            out[field] = json.loads(out[field])
        if not isinstance(out.get(field, {}), (dict, BaseModel)):  # `admission: false`
            out[field] = {FLAT_ALIASES[field][1]: out[field]} if field in FLAT_ALIASES else out[field]
    for field, model in OWN_SETTINGS.items():
        flat = {k: out.pop(k) for k in list(out) if k in model.model_fields}
        flat.update({FLAT_ALIASES[k][1]: out.pop(k) for k in list(out)
                     if k in FLAT_ALIASES and FLAT_ALIASES[k][0] == field and k != field})
        if flat:
            nested = out.get(field)
            nested = nested.model_dump(exclude_unset=True) if isinstance(nested, BaseModel) else dict(nested or {})
            out[field] = {**flat, **nested}
    return out


def flat_name(field: str, name: str) -> str:
    """A nested setting's name alone: its own (balance_factor), or for admission's `enabled`, `admission`."""
    return field if name in FLAT_NAMELESS else name


def flat_names(field: str) -> list[str]:
    """The nested settings of `field` (cache_aware, admission) by their names alone, in the model's order."""
    return [flat_name(field, n) for n in OWN_SETTINGS[field].model_fields]


def former_names(name: str) -> list[str]:
    """The former names a setting (by its name alone) is still accepted under: timeout_s -> [queue_timeout]."""
    nested = own_setting(name)
    return [old for old, to in FLAT_ALIASES.items() if to == nested and old != name] if nested else []


def merge_layers(*layers: dict[str, Any]) -> dict[str, Any]:
    """Layers of settings (plain or nested names) merged, later ones winning setting by setting, also inside a
    strategy's nested settings."""
    out: dict[str, Any] = {}
    for layer in layers:
        for k, v in nest_flat_names(layer).items():
            if k in OWN_SETTINGS and isinstance(out.get(k), dict) and isinstance(v, dict):
                out[k] = {**out[k], **v}
            else:
                out[k] = v
    return out


def own_setting(name: str) -> tuple[str, str] | None:
    """('cache_aware', 'balance_factor') for a nested setting named alone, ('admission', 'timeout_s') for one by
    a former name (queue_timeout) or `admission` itself (its `enabled`); None for any other name."""
    if name in FLAT_ALIASES:
        return FLAT_ALIASES[name]
    for field, model in OWN_SETTINGS.items():
        if name in model.model_fields and name not in FLAT_NAMELESS:
            return field, name
    return None


class Strategy:
    """A named pipeline: `choose` runs it over the routable instances."""

    def __init__(self, name: str, settings: StrategySettings, pipeline: Pipeline, records_prefixes: bool = False
                 ) -> None:
        self.name = name
        self.settings = settings
        self.pipeline = pipeline
        self.records_prefixes = records_prefixes  # whether its choices feed the prefix index

    def choose(self, key: RoutingKey, fleet: Fleet, candidates: list[Instance] | None = None) -> Decision:
        """The choice among `candidates` (routable instances; None: all the routable ones serving the key's model)."""
        if candidates is not None and not candidates:
            raise NoInstanceAvailable("no healthy instance")
        req = Request(key, fleet, routable(fleet, key.model) if candidates is None else candidates)
        inst, reason = self.pipeline.run(req)
        return self.decision(req, inst.name, reason)

    def decision(self, req: Request, instance: str, reason: str) -> Decision:
        return Decision(instance, reason, 0, req.prompt)


class CacheAwareStrategy(Strategy):
    """Lowest estimated time to first token, never at the cost of drowning an instance (its stages: the
    registry's prefix_match, load_guard, slow_start, hot_share, the `scorers` setting's (estimated_ttft), tie_slack,
    least_loaded_ties, rendezvous; docs/architecture.md).

    A prompt kept on the one instance holding its prefix at the private miss weight (`Decision.private`) may
    wait in the router while the prompts in flight there, with it, would need more than `hold_kv_limit` x its
    KV cache: core/admission/ decides, with these settings.
    """

    @property
    def popularity(self) -> Popularity:
        """Which prefixes are hot (hot_share's)."""
        return self.pipeline.stage("hot_share").popularity

    @property
    def exact(self) -> ExactIndex | None:
        """Precise mode's index of what the engines report holding (None: off); prefix_match reads it."""
        return self.pipeline.stage("prefix_match").exact

    @exact.setter
    def exact(self, index: ExactIndex | None) -> None:
        self.pipeline.stage("prefix_match").exact = index

    def decision(self, req: Request, instance: str, reason: str) -> Decision:
        depth = req.depths.get(instance, 0)
        matched = min(req.prompt, depth * req.block_tokens)
        d = Decision(instance, reason, matched, req.prompt, req.blocks, req.holder == PRIVATE and reason == CACHE_HIT)
        d.depth = depth
        if req.precise is not None:
            share = req.precise.get(instance)
            d.match = APPROXIMATE if share is None else PRECISE
            if share is not None:  # exactly what the engine reported, not rounded to the key's blocks
                d.matched_tokens = round(share * req.prompt)
        return d


@dataclass(frozen=True)
class StrategySpec:
    """A strategy's profile: its stages, by their names in warmroute.core.stages.STAGES, in pipeline order (each
    stage's parameters are declared there, next to its code)."""

    stages: tuple[str, ...]
    cls: type[Strategy] = Strategy
    records_prefixes: bool = False

    @classmethod
    def of(cls, stages: Sequence[str]) -> StrategySpec:
        """The profile of these stages: with prefix_match, a CacheAwareStrategy whose choices feed the prefix index
        (as cache_aware); else a plain one."""
        stages = tuple(stages)
        matched = "prefix_match" in stages
        return cls(stages, CacheAwareStrategy if matched else Strategy, records_prefixes=matched)

    def build(self, name: str, settings: StrategySettings, handles: Handles) -> Strategy:
        made: list[Stage] = []
        for n in self.stages:
            stage = STAGES[n](settings, handles)
            made += stage if isinstance(stage, list) else [] if stage is None else [stage]
        pipeline = Pipeline([s for s in made if isinstance(s, Facts)], [s for s in made if isinstance(s, Filter)],
                            [s for s in made if isinstance(s, Scorer)], [s for s in made if isinstance(s, Picker)])
        return self.cls(name, settings, pipeline, self.records_prefixes)


_KINDS = (Facts, Filter, Scorer, Picker)  # the order a pipeline runs them in (pipeline.py)
_KIND_NAMES = {Facts: "facts", Filter: "a filter", Scorer: "a scorer", Picker: "a picker"}


def stages_problem(stages: Sequence[str]) -> str | None:
    """Why these stages make no strategy (None: they do): unknown, repeated, out of the pipeline's order (facts,
    filters, scorers, pickers), a stage without the stages whose facts it reads, no picker that chooses last."""
    if not stages:
        return "stages: at least one stage is needed, the last a picker"
    for n in stages:
        if n not in STAGES:
            return f"unknown stage {n!r}; known: {', '.join(STAGES)}"
    seen: list[str] = []
    for n in stages:
        if n in seen:
            return f"stage {n!r} is listed twice"
        kind = STAGES[n].kind
        later = next((p for p in seen if _KINDS.index(STAGES[p].kind) > _KINDS.index(kind)), None)
        if later is not None:
            return (f"stage {n!r} ({_KIND_NAMES[kind]}) comes after {later!r} ({_KIND_NAMES[STAGES[later].kind]}): "
                    "the order is facts, filters, scorers, pickers")
        seen.append(n)
    for n in stages:
        missing = [m for m in STAGES[n].needs if m not in stages]
        if missing:
            return f"stage {n!r} reads what {missing[0]!r} works out: add {missing[0]!r} to the stages"
    last = stages[-1]
    if not STAGES[last].picks:
        choosers = [n for n, d in STAGES.items() if d.picks]
        return f"the last stage must be a picker that chooses ({', '.join(choosers)}), not {last!r}"
    return None


def _builtin(*stages: str) -> StrategySpec:
    problem = stages_problem(stages)
    assert problem is None, problem
    return StrategySpec.of(stages)


CACHE_AWARE = _builtin("prefix_match", "load_guard", "slow_start", "hot_share", "scorers", "slot_wait", "tie_slack",
                       "least_loaded_ties", "rendezvous")
# The built-in profiles; the config may define more (StrategyProfile, under `strategies`).
STRATEGIES: dict[str, StrategySpec] = {
    "cache_aware": CACHE_AWARE,
    "prefix": _builtin("prefix_affinity"),
    "session": _builtin("session_affinity"),
    "least_loaded": _builtin("least_loaded"),
    "round_robin": _builtin("round_robin"),
    "random": _builtin("random"),
}
# Strategy settings the admission queue reads (core/admission/settings.py), whatever the stages.
ADMISSION_PARAMS = ("concurrency_threshold", "hold_kv_limit", "hold_keep", "hold_timeout")


class StrategyProfile(SettingsModel):
    """A strategy defined in the config (`strategies: NAME: {...}`): its stages, and settings of its own over the
    strategy settings."""

    stages: list[str] | None = None
    """Stage names in pipeline order (warmroute.core.stages.STAGES); unset: base's."""
    base: str | None = None
    """A built-in strategy whose stages are the default."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Strategy settings (prefix_length, concurrency_threshold, cache_aware's own, nested or by plain name) that
    this strategy uses instead of the configured ones."""

    @field_validator("settings")
    @classmethod
    def _valid_settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            StrategySettings(**v)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = [str(x) for x in err.get("loc") or ()]
            where = ".".join(loc[1:] if len(loc) > 1 and loc[0] in OWN_SETTINGS else loc)
            if err["type"] == "extra_forbidden":
                raise ValueError(f"unknown setting {where!r}; known: "
                                 f"{', '.join(n for n in StrategySettings.model_fields if n not in OWN_SETTINGS)} "
                                 f"and {', '.join(OWN_SETTINGS)}'s own") from None
            raise ValueError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from None
        return v

    @model_validator(mode="after")
    def _valid_stages(self) -> StrategyProfile:
        if self.base is not None and self.base not in STRATEGIES:
            raise ValueError(f"base {self.base!r} is not a built-in strategy; one of {', '.join(STRATEGIES)}")
        if self.stages is None and self.base is None:
            raise ValueError("give its stages (a list of stage names), or a base strategy")
        problem = stages_problem(self.pipeline())
        if problem:
            raise ValueError(problem)
        read = {p for n in self.pipeline() for p in STAGES[n].params} | set(ADMISSION_PARAMS)
        unread = [n for n in _plain_names(self.settings) if n not in read]
        if unread:
            raise ValueError(f"setting {unread[0]!r} is read by none of its stages ({', '.join(self.pipeline())})")
        return self

    def pipeline(self) -> tuple[str, ...]:
        return tuple(self.stages) if self.stages is not None else STRATEGIES[self.base or ""].stages

    def spec(self) -> StrategySpec:
        return StrategySpec.of(self.pipeline())

    def applied(self, settings: StrategySettings) -> StrategySettings:
        """`settings` with this strategy's own settings over them."""
        if not self.settings:
            return settings
        base = settings.strategy_settings().model_dump()
        return StrategySettings(**merge_layers(base, self.settings))


def _plain_names(values: dict[str, Any]) -> list[str]:
    """The settings named in a layer, nested ones by their plain names."""
    out = []
    for k, v in nest_flat_names(values).items():
        out += list(v) if k in OWN_SETTINGS and isinstance(v, dict) else [k]
    return out


def check_profiles(profiles: dict[str, StrategyProfile]) -> dict[str, StrategyProfile]:
    """Profiles named after a built-in strategy are refused (the built-ins decide as documented)."""
    clash = [n for n in profiles if n in STRATEGIES]
    if clash:
        raise ValueError(f"{clash[0]!r} is a built-in strategy; give yours another name")
    bad = [n for n in profiles if not n or not all(c.isalnum() or c in "_-." for c in n)]
    if bad:
        raise ValueError(f"strategy name {bad[0]!r}: use letters, digits, '_', '-' or '.'")
    return profiles


def strategy_names(profiles: dict[str, StrategyProfile] | None = None) -> list[str]:
    return [*STRATEGIES, *(profiles or {})]


def settings_for(name: str, settings: StrategySettings, profiles: dict[str, StrategyProfile] | None = None
                 ) -> StrategySettings:
    """The settings strategy `name` decides with: a profile's own over `settings` (unchanged for a built-in)."""
    profile = (profiles or {}).get(name) if name not in STRATEGIES else None
    return profile.applied(settings) if profile is not None else settings


def make_strategy(name: str, settings: StrategySettings | None = None, seed: int | None = None,
                  handles: Handles | None = None, profiles: dict[str, StrategyProfile] | None = None) -> Strategy:
    """The strategy registered as `name` (a built-in, or one of `profiles`, defined in the config), built from
    `settings` (defaults if None; a profile's own settings over them)."""
    settings = settings or StrategySettings()
    if name in STRATEGIES:
        spec = STRATEGIES[name]
    elif profiles and name in profiles:
        spec = profiles[name].spec()
        settings = profiles[name].applied(settings)
    else:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(strategy_names(profiles))}") from None
    return spec.build(name, settings, handles or Handles(seed=seed))


# The admission queue's settings model, nested as StrategySettings.admission (imported last: its package imports
# this module).
from warmroute.core.admission.settings import ADMISSION_ALIASES, AdmissionConfig  # noqa: E402

OWN_SETTINGS["admission"] = AdmissionConfig
FLAT_ALIASES.update({old: ("admission", new) for old, new in ADMISSION_ALIASES.items()})
# Nested settings with no flat name of their own: admission's `enabled` is named `admission` alone.
FLAT_NAMELESS = frozenset({"enabled"})
StrategySettings.model_rebuild()
