import collections
import math
import random

import pytest

from fleet_helpers import SYSTEM, conversation_on_the_first_of_two, fleet, key
from warmroute.core import rendezvous
from warmroute.core.fleet import Fleet
from warmroute.core.routing_key import key_for_json
from warmroute.core.pipeline import Request, Scorer
from warmroute.core.stages import SCORERS
from warmroute.core.strategies import (CACHE_HIT, COLD, KV_SPILL, OVERLOAD_SPILL, UNHEALTHY_FALLBACK,
                                       NoInstanceAvailable, StrategySettings, make_strategy)


def route(strategy, f: Fleet, k):
    d = strategy.choose(k, f)
    f.dispatched(d.instance, d.uncached_tokens, list(d.blocks) if strategy.records_prefixes else None)
    return d


def test_prefix_follows_rendezvous_on_the_first_prefix_length_characters():
    f = fleet()
    s = make_strategy("prefix", StrategySettings(prefix_length=1024))
    k1, k2 = key(SYSTEM, "a"), key(SYSTEM, "b")
    assert s.choose(k1, f).instance == s.choose(k2, f).instance == rendezvous.top(k1.prefix_hash(1024), list(f.instances))


def test_prefix_spills_along_its_own_rendezvous_order_then_least_loaded():
    f = fleet()
    s = make_strategy("prefix", StrategySettings(prefix_length=1024, concurrency_threshold=2))
    k = key(SYSTEM)
    order = rendezvous.order(k.prefix_hash(1024), list(f.instances))
    chosen = [route(s, f, k).instance for _ in range(8)]
    assert chosen == [order[0]] * 2 + [order[1]] * 2 + [order[2]] * 2 + [order[3]] * 2
    d = route(s, f, k)  # everyone at the threshold: least loaded (all equal: by name)
    assert d.reason == OVERLOAD_SPILL and d.instance == "i0"


def test_prefix_skips_an_unhealthy_preferred_instance():
    f = fleet()
    s = make_strategy("prefix", StrategySettings(prefix_length=1024))
    k = key(SYSTEM)
    order = rendezvous.order(k.prefix_hash(1024), list(f.instances))
    f.instances[order[0]].healthy = False
    d = s.choose(k, f)
    assert d.instance == order[1] and d.reason == UNHEALTHY_FALLBACK


@pytest.mark.parametrize("name", ["cache_aware", "prefix", "session", "least_loaded", "round_robin", "random"])
def test_no_routable_instance_raises(name):
    f = fleet(2)
    for i in f.instances.values():
        i.healthy = False
    with pytest.raises(NoInstanceAvailable):
        make_strategy(name).choose(key(SYSTEM), f)


def test_cache_aware_returns_to_the_instance_holding_the_longest_prefix():
    f = fleet()
    s = make_strategy("cache_aware")
    first = route(s, f, key(SYSTEM, "first question"))
    assert first.reason == COLD and first.matched_tokens == 0
    f.finished(first.instance, first.uncached_tokens, got_first_token=False)
    again = route(s, f, key(SYSTEM, "another question"))
    assert again.instance == first.instance and again.reason == CACHE_HIT
    assert again.matched_ratio > 0.9


def test_cache_aware_prefers_a_cached_prefix_over_an_idle_instance_until_the_queue_costs_more():
    f = fleet(2)
    s = make_strategy("cache_aware", StrategySettings(balance_factor=10.0))  # isolate the cost model
    warm = route(s, f, key(SYSTEM, "q0"))
    f.finished(warm.instance, warm.uncached_tokens, got_first_token=False)
    other = next(n for n in f.instances if n != warm.instance)
    alpha = s.settings.cache_aware.miss_weight  # one instance holds the prefix: a private one
    prompt = key(SYSTEM, "q1").tokens
    f.instances[warm.instance].queued_prefill_tokens = 0.5 * alpha * prompt  # less than α x a cold prefill
    assert s.choose(key(SYSTEM, "q1"), f).instance == warm.instance
    f.instances[warm.instance].queued_prefill_tokens = 1.5 * alpha * prompt  # more queued work than that
    d = s.choose(key(SYSTEM, "q1"), f)
    assert d.instance == other and d.reason == OVERLOAD_SPILL


def test_cache_aware_sticks_to_a_private_prefix_but_copies_a_shared_one():
    """The miss weight depends on who holds the prefix: the same queue in front of the holders keeps a prefix
    only one instance holds there, and sends a prefix two instances hold to a third, idle one."""
    f = fleet(3)
    s = make_strategy("cache_aware", StrategySettings(balance_factor=10.0))
    a, b, c = sorted(f.instances)
    k = key(SYSTEM, "q1")
    queue = 4 * k.tokens  # between the shared (1) and the private (16) miss weight x the prompt
    f.index.record(a, k.blocks())
    f.instances[a].queued_prefill_tokens = f.instances[b].queued_prefill_tokens = queue
    assert s.choose(k, f).instance == a
    f.index.record(b, k.blocks())
    d = s.choose(k, f)
    assert d.instance == c and d.reason == OVERLOAD_SPILL and d.matched_tokens == 0


def test_cache_aware_lets_a_private_prefix_go_when_its_holder_is_swamped():
    """A conversation stays on the one instance holding its history despite a queue there, until the prompts in
    flight there need more than sticky_kv_limit x its KV cache: then the engine would evict the history before
    its turn, and the turn goes where it starts soonest. Other routers' requests (engine-reported) count too."""
    from warmroute.core.engine_load import EngineLoad

    f, s, a, b, k, holder = conversation_on_the_first_of_two()
    holder.inflight_prompt_tokens = 30_000  # 3 x its KV cache: still sticky
    assert s.choose(k, f).instance == a
    holder.inflight_prompt_tokens = 30_001
    d = s.choose(k, f)
    assert d.instance == b and d.reason == KV_SPILL and d.matched_tokens == 0
    holder.inflight_prompt_tokens = 16_000  # 1.6 x from this router's books...
    assert s.choose(k, f).instance == a
    holder.engine = EngineLoad(waiting=4, running=4, foreign_requests=4.0)  # ...3.2 x with another router's
    assert s.choose(k, f).instance == b
    never = make_strategy("cache_aware", StrategySettings(balance_factor=10.0, sticky_kv_limit=1000.0))
    assert never.choose(k, f).instance == a


@pytest.mark.parametrize("slack", [0, 2])
def test_cache_aware_bounded_load_guard(slack):
    f = fleet(4)
    s = make_strategy("cache_aware", StrategySettings(balance_factor=0.25, balance_slack=slack,
                                                      concurrency_threshold=1024))
    for n in range(1, 41):  # one prefix, nothing ever finishes: affinity alone would pile all on one
        route(s, f, key(SYSTEM))
        loads = [i.inflight for i in f.instances.values()]
        assert max(loads) <= math.ceil(1.25 * n / 4) + slack
    if slack == 0:  # strict balance forces the hot prefix onto every instance
        assert min(loads) > 0


def test_cache_aware_respects_the_concurrency_threshold():
    f = fleet(3)
    s = make_strategy("cache_aware", StrategySettings(concurrency_threshold=2, balance_factor=10.0))
    for _ in range(6):
        route(s, f, key(SYSTEM))
    assert [i.inflight for i in f.instances.values()] == [2, 2, 2]


def test_cold_placement_is_the_same_for_every_replica():
    """Two routers with separate state place the same cold prefixes on the same instances."""
    a, b = fleet(8), fleet(8)
    sa, sb = make_strategy("cache_aware"), make_strategy("cache_aware")
    prompts = [f"system prompt number {p} " * 80 for p in range(30)]
    assert [sa.choose(key(p), a).instance for p in prompts] == [sb.choose(key(p), b).instance for p in prompts]


def test_hot_prompt_warms_a_few_instances_and_never_breaks_the_guard():
    """60% of traffic shares one system prompt: it ends up on several warm instances, not pinned to one, and
    no instance ever holds more than the guard allows. (Request-count balance under real service times is
    checked in the simulator: tests/sim/test_simulator.py.)"""
    rng = random.Random(0)
    f = fleet(4)
    settings = StrategySettings()
    s = make_strategy("cache_aware", settings)
    hot_instances: collections.Counter[str] = collections.Counter()
    running: list[tuple[str, int]] = []
    for n in range(4000):
        hot = rng.random() < 0.6
        system = SYSTEM if hot else f"tenant {rng.randrange(40)} policies " * 100
        d = route(s, f, key(system, f"q{n}"))
        if hot:
            hot_instances[d.instance] += 1
        loads = [i.inflight for i in f.instances.values()]
        guard = settings.cache_aware
        assert max(loads) <= math.ceil((1 + guard.balance_factor) * sum(loads) / 4) + guard.balance_slack
        running.append((d.instance, d.uncached_tokens))
        if len(running) > 16:  # a steady 16 in flight: the oldest completes
            name, unc = running.pop(0)
            f.finished(name, unc, got_first_token=False)
    assert len(hot_instances) >= 2 and max(hot_instances.values()) < 0.8 * sum(hot_instances.values())


def test_session_strategy_is_sticky_per_session():
    f = fleet(6)
    s = make_strategy("session")
    k1 = key_for_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "user": "alice"})
    k2 = key_for_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}], "user": "alice"})
    assert s.choose(k1, f).instance == s.choose(k2, f).instance


def test_round_robin_and_least_loaded():
    f = fleet(3)
    rr = make_strategy("round_robin")
    assert len({route(rr, f, key("x")).instance for _ in range(3)}) == 3
    f.instances["i1"].inflight = 0
    f.instances["i0"].inflight = f.instances["i2"].inflight = 5
    assert make_strategy("least_loaded").choose(key("x"), f).instance == "i1"


def test_random_is_reproducible_with_a_seed():
    f = fleet(5)
    r1, r2 = make_strategy("random", seed=3), make_strategy("random", seed=3)
    picks = [r1.choose(key("x"), f).instance for _ in range(20)]
    assert picks == [r2.choose(key("x"), f).instance for _ in range(20)] and len(set(picks)) > 1


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown strategy"):
        make_strategy("fastest")


class _Prefers(Scorer):
    """A scorer registered by a test: instance `favourite` costs nothing, every other one a second."""

    name = "prefers"

    def __init__(self, favourite: str) -> None:
        self.favourite = favourite

    def score(self, req, candidates):
        return [0.0 if i.name == self.favourite else 1.0 for i in candidates]


def test_a_registered_scorer_is_named_by_the_scorers_setting_and_runs(monkeypatch):
    monkeypatch.setitem(SCORERS, "prefers", lambda s, h: _Prefers("i2"))
    f = fleet()
    settings = StrategySettings(scorers={"estimated_ttft": 1.0, "prefers": 2.0})
    s = make_strategy("cache_aware", settings)
    assert [(x.name, x.weight) for x in s.pipeline.scorers] == [("estimated_ttft", 1.0), ("prefers", 2.0)]
    d = s.choose(key(SYSTEM), f)
    assert d.instance == "i2" and d.reason == COLD
    with pytest.raises(ValueError, match="unknown scorer 'absent'"):
        StrategySettings(scorers="estimated_ttft=1,absent=1")


def test_the_trace_says_which_stage_removed_which_instance():
    f = fleet()
    s = make_strategy("cache_aware", StrategySettings(concurrency_threshold=3))
    f.instances["i1"].inflight = 3  # at the ConcurrencyThreshold: the load guard removes it
    f.instances["i3"].healthy = False
    req = Request(key(SYSTEM), f, f.routable())
    s.pipeline.run(req)
    trace = dict(s.pipeline.trace(req))
    assert trace["routable"] == ["i0", "i1", "i2"]
    assert trace["load_guard"] == ["i0", "i2"]
    assert trace["hot_share"] == ["i0", "i2"]  # not hot: keeps them all
    assert set(trace["least_loaded_ties"]) <= {"i0", "i2"}
