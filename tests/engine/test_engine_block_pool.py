"""The emulated engine's block pool: reference counts, the LRU free queue, duplicate blocks, as in vLLM V1."""

from __future__ import annotations

import pytest

from warmroute.engine.block_pool import BlockPool


def test_shared_blocks_are_counted_once_and_freed_by_the_last_user() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache(a[0], "h0")
    hits = pool.cached_prefix(["h0", "h1"])
    assert hits == [a[0]]
    pool.take(hits)  # a second sequence uses a's first block
    assert a[0].ref_cnt == 2 and pool.usage == 0.5
    pool.free(reversed(a))
    assert pool.num_free_blocks == 3 and "h0" in pool  # still held by the second sequence
    pool.free(hits)
    assert pool.num_free_blocks == 4 and pool.lru_order() == ["h0"]


def test_a_cached_block_is_evicted_only_when_its_slot_is_handed_out() -> None:
    pool = BlockPool(2)
    b = pool.allocate(2)
    pool.cache(b[0], "x")
    pool.cache(b[1], "y")
    pool.free(reversed(b))  # y first: it goes before x
    assert pool.lru_order() == ["y", "x"]
    assert pool.match(["x", "y"]) == 2
    pool.allocate(1)
    assert "y" not in pool and "x" in pool and pool.match(["x", "y"]) == 1


def test_taking_a_free_cached_block_leaves_less_to_allocate() -> None:
    pool = BlockPool(3)
    b = pool.allocate(3)
    pool.cache(b[0], "x")
    pool.free(b)
    hits = pool.cached_prefix(["x"])
    assert pool.can_allocate(hits, 2) and not pool.can_allocate(hits, 3)
    pool.take(hits)
    assert len(pool.allocate(2)) == 2 and "x" in pool
    with pytest.raises(ValueError):
        pool.allocate(1)


def test_the_same_block_computed_twice_keeps_both_copies() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache(a[0], "same")
    pool.cache(b[0], "same")
    assert len(pool) == 2
    pool.free(a + b)
    pool.allocate(2)  # the empty third block, then a's copy
    assert "same" in pool and pool.cached_prefix(["same"]) == b
    with pytest.raises(ValueError, match="already"):
        pool.cache(b[0], "other")
