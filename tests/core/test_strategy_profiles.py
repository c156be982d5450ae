"""Strategies defined as profiles (issue #33): the built-ins are profiles, a user's profile decides as its stages
and settings say, and a bad one is refused with one line naming the problem."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from warmroute.core.stages import STAGES
from warmroute.core.strategies import (CACHE_AWARE, STRATEGIES, CacheAwareStrategy, Strategy, StrategyProfile,
                                       StrategySettings, check_profiles, make_strategy, settings_for, stages_problem)
from warmroute.sim.simulator import SimSettings, Simulation
from warmroute.workloads.registry import make_workload

CACHE_AWARE_STAGES = list(CACHE_AWARE.stages)


def _run(strategy: str, profiles: dict[str, StrategyProfile] | None = None, requests: int = 400):
    settings = SimSettings(instances=4, requests=requests, rate=8.0, kv_capacity_tokens=30_000, max_running=32,
                           seed=1, profiles=profiles or {})
    return Simulation(settings, make_workload("mixed", seed=1), strategy).run()


def _decisions(result) -> list[tuple]:
    return [(r.arrival, r.instance, r.reason, r.cached_tokens, r.first_token) for r in result.records]


def test_the_builtins_are_valid_profiles():
    for name, spec in STRATEGIES.items():
        assert stages_problem(spec.stages) is None, name
    assert STRATEGIES["cache_aware"].cls is CacheAwareStrategy and STRATEGIES["cache_aware"].records_prefixes
    assert all(STRATEGIES[n].cls is Strategy and not STRATEGIES[n].records_prefixes
               for n in ("prefix", "session", "least_loaded", "round_robin", "random"))


def test_a_profile_with_cache_awares_stages_decides_exactly_as_cache_aware():
    mine = {"mine": StrategyProfile(stages=CACHE_AWARE_STAGES), "based": StrategyProfile(base="cache_aware")}
    built = make_strategy("mine", profiles=mine)
    assert isinstance(built, CacheAwareStrategy) and built.records_prefixes
    reference = _decisions(_run("cache_aware"))
    assert _decisions(_run("mine", mine)) == reference
    assert _decisions(_run("based", mine)) == reference


def test_a_profile_with_other_settings_decides_otherwise():
    sticky = StrategyProfile(base="cache_aware", settings={"miss_weight": 1.0, "shared_miss_weight": 1000.0,
                                                           "balance_factor": 0.0, "balance_slack": 0})
    applied = settings_for("sticky", StrategySettings(), {"sticky": sticky})
    assert applied.cache_aware.miss_weight == 1.0 and applied.cache_aware.balance_slack == 0
    assert settings_for("cache_aware", StrategySettings(), {"sticky": sticky}) == StrategySettings()
    assert _decisions(_run("sticky", {"sticky": sticky})) != _decisions(_run("cache_aware"))


def test_a_profile_without_prefix_match_is_a_plain_strategy():
    built = make_strategy("ll", profiles={"ll": StrategyProfile(stages=["load_guard", "least_loaded"])})
    assert type(built) is Strategy and not built.records_prefixes
    assert [s.name for s in built.pipeline._stages] == ["load_guard", "least_loaded"]


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown strategy 'nope'.*mine"):
        make_strategy("nope", profiles={"mine": StrategyProfile(base="random")})


@pytest.mark.parametrize("profile, needle", [
    ({"stages": []}, "at least one stage"),
    ({"stages": ["prefix_match", "teleport", "rendezvous"]}, "unknown stage 'teleport'"),
    ({"stages": ["prefix_match", "load_guard"]}, "last stage must be a picker"),
    ({"stages": ["prefix_match", "scorers", "tie_slack"]}, "last stage must be a picker that chooses"),
    ({"stages": ["scorers", "tie_slack", "rendezvous"]}, "'scorers' reads what 'prefix_match' works out"),
    ({"stages": ["load_guard", "hot_share", "least_loaded"]}, "'hot_share' reads what 'prefix_match'"),
    ({"stages": ["prefix_match", "tie_slack", "rendezvous"]}, "'tie_slack' reads what 'scorers'"),
    ({"stages": ["rendezvous", "load_guard", "least_loaded"]}, "'load_guard' (a filter) comes after 'rendezvous'"),
    ({"stages": ["random", "random"]}, "listed twice"),
    ({}, "give its stages"),
    ({"base": "fastest"}, "base 'fastest' is not a built-in strategy"),
    ({"base": "cache_aware", "settings": {"miss_wieght": 3}}, "unknown setting 'miss_wieght'"),
    ({"base": "cache_aware", "settings": {"balance_factor": 50}}, "balance_factor: Input should be less than"),
    ({"base": "random", "settings": {"miss_weight": 3}}, "'miss_weight' is read by none of its stages"),
    ({"base": "cache_aware", "stagse": ["random"]}, "stagse"),
])
def test_each_bad_profile_is_one_line_naming_the_problem(profile, needle):
    with pytest.raises(ValidationError) as exc:
        StrategyProfile(**profile)
    errors = exc.value.errors()
    assert len(errors) == 1 and "\n" not in errors[0]["msg"]
    assert needle in errors[0]["msg"] or needle in str(errors[0]["loc"])


def test_a_profile_may_not_take_a_builtins_name():
    with pytest.raises(ValueError, match="'cache_aware' is a built-in strategy"):
        check_profiles({"cache_aware": StrategyProfile(base="cache_aware")})


def test_every_stage_declares_its_kind_and_what_it_needs():
    for name, stage in STAGES.items():
        assert all(n in STAGES for n in stage.needs), name
        assert not stage.picks or stage.kind.__name__ == "Picker", name
