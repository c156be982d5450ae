import os
import random
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

from warmroute.core import prefix_index
from warmroute.core.block_hash import block_hashes
from index_ops import apply_op
from warmroute.core.prefix_index import STORES, CompiledPrefixIndex, PythonPrefixIndex


@pytest.fixture(params=STORES, ids=lambda c: c.__name__)
def PrefixIndex(request):
    """Each test runs on both stores (the compiled one where it was built)."""
    return request.param


def chain(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return block_hashes(bytes(rng.getrandbits(8) for _ in range(64 * n)))


def test_match_depths_per_instance(PrefixIndex):
    idx = PrefixIndex(10_000)
    for name in ("a", "b", "c"):
        idx.add_instance(name, 1000)
    blocks = chain(40, 1)
    idx.record("a", blocks[:40])
    idx.record("b", blocks[:13])
    idx.record("c", chain(5, 2))
    assert idx.match_depths(blocks) == {"a": 40, "b": 13}
    assert idx.match_depths(blocks[:10]) == {"a": 10, "b": 10}
    assert idx.match_depths(chain(3, 99)) == {}


def test_match_depths_agree_with_a_linear_scan(PrefixIndex):
    rng = random.Random(3)
    idx = PrefixIndex(100_000)
    names = [f"i{j}" for j in range(6)]
    for n in names:
        idx.add_instance(n, 300)  # small: evictions happen
    base = chain(120, 5)
    for _ in range(400):
        n = rng.choice(names)
        idx.record(n, base[: rng.randint(1, 120)] if rng.random() < 0.7 else chain(rng.randint(1, 30), rng.random()))
    for depth in (1, 7, 64, 120):
        q = base[:depth]
        expected = {}
        for n in names:
            d = 0
            while d < len(q) and idx.holds(n, q[d]):
                d += 1
            if d:
                expected[n] = d
        assert idx.match_depths(q) == expected


def test_each_instance_is_capped_and_evicts_lru(PrefixIndex):
    idx = PrefixIndex(10_000)
    idx.add_instance("a", 100)
    old, new = chain(60, 1), chain(60, 2)
    idx.record("a", old)
    idx.record("a", new)
    assert idx.entries("a") == 100
    assert idx.match_depths(new) == {"a": 60}
    assert idx.match_depths(old) == {"a": 40}  # the old chain lost its tail, never its head


def test_total_entries_never_exceed_the_cap(PrefixIndex):
    idx = PrefixIndex(5_000)
    for j in range(4):
        idx.add_instance(f"i{j}", 10**9)  # configured capacity far above the memory cap
    rng = random.Random(0)
    for p in range(3000):
        idx.record(f"i{p % 4}", block_hashes(rng.randbytes(64 * 8), p))
        assert idx.entries() <= 5_000
    first = block_hashes(random.Random(0).randbytes(64 * 8), 0)
    assert idx.match_depths(first) == {}  # the least recently used went first
    idx.add_instance("i4", 10**9)  # a new instance shrinks everyone's share
    assert idx.entries() <= 5_000 and all(idx.entries(f"i{j}") <= 1000 for j in range(5))


def test_remove_and_forget(PrefixIndex):
    idx = PrefixIndex(1000)
    idx.add_instance("a", 100)
    idx.add_instance("b", 100)
    c = chain(10, 1)
    idx.record("a", c)
    idx.record("b", c)
    assert idx.forget("a", c[4:]) == 6
    assert idx.match_depths(c) == {"a": 4, "b": 10}
    idx.remove_instance("b")
    assert idx.match_depths(c) == {"a": 4}
    idx.add_instance("c", 100)  # reuses b's bit; must not inherit b's blocks
    assert idx.match_depths(c) == {"a": 4}


def test_memory_per_entry_estimate(PrefixIndex):
    """bytes_per_entry (used to turn the byte cap into an entry cap) must not understate real use."""
    idx = PrefixIndex(10**7)
    for j in range(4):
        idx.add_instance(f"i{j}", 10**7)
    rng = random.Random(1)
    chains = [block_hashes(rng.randbytes(64 * 50), p) for p in range(2000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for p, c in enumerate(chains):
        idx.record(f"i{p % 4}", c)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_entry = used / idx.entries()
    assert per_entry <= PrefixIndex.bytes_per_entry, per_entry
    assert per_entry >= PrefixIndex.bytes_per_entry / 3, per_entry  # and is not wildly pessimistic
    if PrefixIndex is CompiledPrefixIndex:  # what the index reports (the index_bytes metric) is what it allocated
        assert abs(idx.estimated_bytes() - used) <= 0.02 * used, (idx.estimated_bytes(), used)


def test_the_compiled_store_is_built_where_required():
    assert prefix_index.NATIVE or os.environ.get("WARMROUTE_REQUIRE_NATIVE") != "1"
    assert prefix_index.PrefixIndex is (CompiledPrefixIndex if prefix_index.NATIVE else PythonPrefixIndex)


needs_compiled = pytest.mark.skipif(not prefix_index.NATIVE, reason="the C prefix index was not built")

# Chains that share heads (0-2 share their first 12 blocks), a reversed one, one with a large hash and hash 0.
_CHAINS = ([list(range(1, 13)) + list(range(1000 * c, 1000 * c + 28)) for c in range(3)]
           + [list(range(40, 0, -1)), [0, 2**64 - 1] + list(range(7000, 7030))])
_NAMES = [f"n{j}" for j in range(6)]
_ops = st.lists(st.one_of(
    st.tuples(st.just("record"), st.sampled_from(_NAMES), st.integers(0, 4), st.integers(0, 40)),
    st.tuples(st.just("forget"), st.sampled_from(_NAMES), st.integers(0, 4), st.integers(0, 40)),
    st.tuples(st.just("resize"), st.sampled_from(_NAMES), st.integers(0, 60)),
    st.tuples(st.just("remove"), st.sampled_from(_NAMES)),
    st.tuples(st.just("add"), st.sampled_from(_NAMES), st.integers(0, 60)),
), max_size=60)


def _state(idx):
    """Everything either store answers."""
    queries = [c[:d] for c in _CHAINS for d in (1, 5, 12, 13, 27, len(c))]
    return ({n: (idx.entries(n), idx.capacity(n), idx.lru_order(n)) for n in idx._slot}, idx.owner_masks(),
            idx.entries(), len(idx), [idx.match_depths(q) for q in queries],
            [(n, b, idx.holds(n, b)) for n in _NAMES for b in (1, 12, 1005, 2005, 40, 0, 2**64 - 1)])


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 150), _ops)
def test_the_compiled_store_answers_as_the_python_one(max_entries, operations):
    """Operation by operation, the C store's LRU order, owner masks, depths and counts are the Python one's."""
    py, c = PythonPrefixIndex(max_entries), CompiledPrefixIndex(max_entries)
    for idx in (py, c):
        idx.add_instance("n0", 50)
        idx.add_instance("n1", 50)
    for op in operations:
        assert apply_op(py, _CHAINS, *op) == apply_op(c, _CHAINS, *op)
        assert _state(py) == _state(c)


@needs_compiled
def test_more_than_64_instances_need_wider_masks():
    """Owner masks grow past one 64-bit word as instances join; slots freed by leavers are reused."""
    py, c = PythonPrefixIndex(10**6), CompiledPrefixIndex(10**6)
    rng = random.Random(5)
    base = chain(80, 9)
    for j in range(150):
        for idx in (py, c):
            idx.add_instance(f"i{j}", 500)
        depth = rng.randint(1, 80)
        for idx in (py, c):
            idx.record(f"i{j}", base[:depth])
        if j % 7 == 3:
            for idx in (py, c):
                idx.remove_instance(f"i{j - 2}")
    assert c.match_depths(base) == py.match_depths(base) and len(c.match_depths(base)) > 100
    assert c.owner_masks() == py.owner_masks() and max(c.owner_masks().values()).bit_length() > 128
    assert all(c.lru_order(n) == py.lru_order(n) for n in py._slot)


@needs_compiled
@pytest.mark.parametrize("bad", [-1, 2**64, "x", 1.5, None])
def test_the_compiled_store_refuses_what_is_not_a_block_hash_and_changes_nothing(bad):
    idx = CompiledPrefixIndex(1000)
    idx.add_instance("a", 100)
    idx.record("a", [1, 2, 3])
    with pytest.raises(ValueError, match="block hashes"):
        idx.record("a", [4, bad, 5])
    with pytest.raises(ValueError, match="block hashes"):
        idx.match_depths([1, bad])
    assert idx.lru_order("a") == [3, 2, 1] and len(idx) == 3
    assert idx.holds("a", bad) is False


@needs_compiled
def test_a_chain_and_its_list_are_the_same_blocks_to_the_compiled_store():
    """block_hash's Chain is read in place (no ints); a list of the same ints must give the same answers."""
    from warmroute.core import block_hash

    if not block_hash.NATIVE:
        pytest.skip("the C block hash was not built")
    c1, c2 = chain(30, 1), chain(30, 2)
    assert type(c1).__name__ == "Chain"
    a, b = CompiledPrefixIndex(10_000), CompiledPrefixIndex(10_000)
    for idx in (a, b):
        idx.add_instance("x", 40)
        idx.add_instance("y", 40)
    a.record("x", c1), b.record("x", c1.tolist())
    a.record("y", c1[:12].tolist()), b.record("y", c1[:12])
    a.record("x", c2), b.record("x", c2.tolist())  # over capacity: x keeps c2's head and evicts c1's tail
    assert a.forget("y", c1[8:]) == b.forget("y", c1[8:].tolist()) == 4
    for q in (c1, c1.tolist(), c1[:5], c2, c2.tolist()):
        assert a.match_depths(q) == b.match_depths(q)
    assert a.match_depths(c1) == {"x": 10, "y": 8}
    assert all(a.lru_order(n) == b.lru_order(n) for n in "xy") and a.owner_masks() == b.owner_masks()


def test_a_cold_chain_is_hashed_no_further_than_its_first_block(PrefixIndex):
    """A lazy Chain computes its hashes as they are read. Nobody holding a chain's first block means nothing
    deeper can match: both stores look no further, so a cold prompt's chain is hashed beyond block 0 only when
    it is recorded (after the request has been sent). A held one is matched exactly."""
    from warmroute.core import block_hash

    if not block_hash.NATIVE:
        pytest.skip("the C block hash was not built")
    rng = random.Random(8)
    warm_data, cold_data = rng.randbytes(64 * 300), rng.randbytes(64 * 300)
    idx = PrefixIndex(10_000)
    idx.add_instance("a", 1000)
    idx.record("a", block_hashes(warm_data[:64 * 120]))
    cold = block_hashes(cold_data)
    assert idx.match_depths(cold) == {} and cold.computed == 1
    warm = block_hashes(warm_data)
    assert idx.match_depths(warm) == {"a": 120}
    idx.record("a", cold)
    assert cold.computed == 300 and idx.match_depths(block_hashes(cold_data)) == {"a": 300}
