"""Popularity (recent requests per prefix) and cache_aware's guard for hot prefixes."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, strategies as st

from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.popularity import Popularity
from warmroute.core.routing_key import key_for_json
from warmroute.core.strategies import HOT_SPREAD, CacheAwareStrategy, Decision, StrategySettings, make_strategy


def test_share_is_the_decayed_fraction_of_requests():
    p = Popularity()
    for _ in range(30):
        p.add(1, 100)
        p.add(None, 100)
        p.add(2, 100)
    assert math.isclose(p.share(1), 1 / 3, rel_tol=0.02) and math.isclose(p.share(2), 1 / 3, rel_tol=0.02)
    assert p.share(3) == 0.0 and Popularity().share(1) == 0.0
    for _ in range(500):  # five windows of other requests: prefix 1 has faded
        p.add(None, 100)
    assert p.share(1) < 0.01 * (1 / 3)


def test_weights_are_rescaled_before_they_overflow():
    p = Popularity()
    for _ in range(20_000):  # a window of 2: each count is worth 1.5x the one before
        p.add(7, 2)
    assert p.share(7) == 1.0 and math.isfinite(p._unit.value) and p._unit.value <= 1e100


@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=3000))
def test_memory_stays_bounded_whatever_the_prefixes(prefixes):
    p = Popularity(max_keys=64)
    for k in prefixes:
        p.add(k, 256)
        assert len(p) <= 64 + 1
    assert 0.0 <= p.share(prefixes[-1]) <= 1.0


def _request(system: str, n: int):
    return key_for_json("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"question {n}"}]})


def _route(strategy: CacheAwareStrategy, fleet: Fleet, key) -> Decision:
    """Decide and book the request as the router does, then finish it (an idle fleet: the cost rule alone
    would keep every hot request on its holders)."""
    d = strategy.choose(key, fleet)
    fleet.dispatched(d.instance, d.uncached_tokens, list(d.blocks))
    fleet.first_token(d.instance, d.uncached_tokens)
    fleet.finished(d.instance)
    return d


def test_a_hot_prefix_is_copied_until_request_counts_are_even():
    hot = "You are the support assistant of a large shop. " * 40
    for factor, bound in ((0.2, 1.3), (1000.0, None)):
        fleet, strategy = Fleet(FleetSettings()), make_strategy("cache_aware", StrategySettings(hot_balance_factor=factor))
        for j in range(4):
            fleet.add(f"i{j}", 10**7)
        counts = {f"i{j}": 0 for j in range(4)}
        reasons: Counter[str] = Counter()
        for n in range(2000):
            # 60% the hot prompt, the rest 40 others that each stay where they were first placed
            system = hot if n % 5 < 3 else f"Tenant {n % 40} has its own instructions. " * 20
            d = _route(strategy, fleet, _request(system, n))
            reasons[d.reason] += 1
            if n >= 500:
                counts[d.instance] += 1
        spread = max(counts.values()) / (sum(counts.values()) / 4)
        holders = sum(1 for j in range(4) if fleet.index.holds(f"i{j}", _request(hot, 0).blocks()[5]))
        if bound is not None:  # each copy is a decision that says so (header, metrics, access log)
            assert spread <= bound and holders >= 3 and reasons[HOT_SPREAD] >= 2
        else:  # without the guard the hot prompt stays where it was first placed
            assert spread > 1.5 and holders == 1 and reasons[HOT_SPREAD] == 0


def test_a_conversation_is_not_moved_by_the_guard():
    """A prefix only one request stream uses is never hot, however busy its instance is."""
    fleet, strategy = Fleet(FleetSettings()), make_strategy("cache_aware")
    for j in range(4):
        fleet.add(f"i{j}", 10**7)
    history = "system: be brief. "
    homes = set()
    for turn in range(30):
        history += f"user: turn {turn} asks something new. assistant: an answer of some length. " * 3
        homes.add(_route(strategy, fleet, key_for_json("/v1/completions", {"prompt": history})).instance)
    assert len(homes) == 1


def test_instances_recent_requests_keep_their_ratios_through_a_rescale():
    fleet = Fleet(FleetSettings())
    for j in range(2):
        fleet.add(f"i{j}", 10**7)
    fleet.recent_unit.value = 1e99  # close to the rescale: the next few requests cross it
    for n in range(300):
        fleet.dispatched("i0" if n % 3 else "i1", 0)
    a, b = fleet.instances["i0"].recent, fleet.instances["i1"].recent
    assert fleet.recent_unit.value < 1e99 and math.isfinite(a) and 1.5 < a / b < 2.5
    # counts and unit were divided by the same factor: i0's count is still about 2/3 of a window (128) of units
    assert 40 * fleet.recent_unit.value < a < 130 * fleet.recent_unit.value


@given(st.lists(st.one_of(st.none(), st.integers(0, 20)), max_size=300), st.floats(0.5, 50.0))
def test_add_returns_the_share_the_prefix_had_before(prefixes, window):
    p = Popularity(max_keys=8)
    for prefix in prefixes:
        before = p.share(prefix) if prefix is not None else 0.0
        assert p.add(prefix, window) == before
