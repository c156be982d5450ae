"""Cache value (core/cache_value.py): what each instance holds that no other does, the scale-in victim."""

from __future__ import annotations

import math

import pytest

from warmroute.core.cache_value import DELETION_COST_MAX, CacheValue, deletion_costs, scale_in_victim, sole_lead
from warmroute.core.prefix_index import STORES


@pytest.fixture(params=STORES, ids=lambda c: c.__name__)
def index(request):
    idx = request.param(100_000)
    for name in ("a", "b", "c"):
        idx.add_instance(name, 10_000)
    return idx


def chain(first: int, n: int) -> list[int]:
    return [first * 1000 + i for i in range(n)]


def test_sole_lead_is_the_deepest_holders_blocks_beyond_the_next():
    assert sole_lead({"a": 10, "b": 4}) == ("a", 4, 10)  # 6 blocks only a holds
    assert sole_lead({"a": 10, "b": 10}) is None  # held twice: losing one costs nothing
    assert sole_lead({"a": 3}) == ("a", 0, 3)
    assert sole_lead({}) is None
    assert sole_lead({"a": 10, "b": 4, "c": 0}) == ("a", 4, 10) and sole_lead({"a": 2, "b": 2}) is None


def test_each_block_only_one_instance_holds_counts_once_by_its_chance_of_being_asked_again(index):
    index.record("a", chain(1, 20))  # a hot prefix only a holds
    index.record("b", chain(2, 20))  # a rare prefix only b holds
    index.record("b", chain(3, 20))
    index.record("c", chain(3, 20))  # c's only prefix is also held by b
    value = CacheValue()
    for _ in range(9):
        value.requested(chain(1, 20))
    value.requested(chain(2, 20))
    value.requested(chain(3, 20))
    v = value.values(index, ["a", "b", "c"], block_tokens=16)
    # Losing a costs its 320 tokens once (the next request copies them elsewhere): nine requests make that
    # near certain, not nine times as costly; b's prefix, asked for once, costs 1 - 1/e of its tokens.
    assert v["a"] == pytest.approx(320, rel=0.01) and v["b"] == pytest.approx((1 - math.exp(-1)) * 320, rel=0.02)
    assert v["c"] == 0.0
    assert scale_in_victim(v) == "c"
    costs = deletion_costs(v)
    assert costs["a"] > costs["b"] > costs["c"] == 0


def test_a_block_shared_by_several_chains_counts_once(index):
    doc = chain(5, 30)
    index.record("a", doc + chain(6, 2))  # one document, two questions about it, both answered by a
    index.record("a", doc + chain(7, 2))
    index.record("b", chain(8, 34))  # as many blocks, asked for as often, in one chain
    value = CacheValue()
    for _ in range(3):
        value.requested(doc + chain(6, 2))
        value.requested(doc + chain(7, 2))
        value.requested(chain(8, 34))
        value.requested(chain(8, 34))
    v = value.values(index, ["a", "b"], block_tokens=16)
    assert v["a"] == pytest.approx(v["b"], rel=0.05)  # 34 blocks each (the document once), near certain again


def test_a_prefix_no_longer_asked_for_fades(index):
    index.record("a", chain(1, 10))
    index.record("b", chain(2, 10))
    value = CacheValue(window=50)
    for _ in range(20):
        value.requested(chain(1, 10))
    for _ in range(500):
        value.requested(chain(2, 10))
    v = value.values(index, ["a", "b"], 16)
    assert v["a"] < 0.01 * v["b"]
    assert scale_in_victim(v) == "a"


def test_memory_is_bounded_and_the_heavy_chains_stay(index):
    value = CacheValue(max_chains=64)
    for i in range(1000):
        value.requested(chain(7, 5))  # one chain asked for all the time
        value.requested(chain(10_000 + i, 5))  # and many asked for once
    assert len(value) <= 64
    index.record("a", chain(7, 5))
    assert value.values(index, ["a", "b"], 16)["a"] > 0


def test_victim_and_costs_edge_cases():
    assert scale_in_victim({}) is None
    assert scale_in_victim({"x": 0.0, "y": 0.0}) == "y"  # ties: deterministic
    assert deletion_costs({"x": 1e12, "y": -1.0}) == {"x": DELETION_COST_MAX, "y": 0}
    assert CacheValue().values(None, ["a"], 16) == {"a": 0.0}  # nothing requested yet: the index is not asked
