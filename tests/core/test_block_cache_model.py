"""BlockCache and PrefixIndex against simple models, over random operation sequences: the batched eviction
callback and the C-loop refresh in BlockCache.touch must not change what is cached, in which LRU order, or
which blocks are reported as evicted."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from warmroute.core.block_cache import BlockCache
from index_ops import apply_op
from warmroute.core.prefix_index import STORES


class ModelCache:
    """LRU as a plain list (least recent first), the semantics BlockCache documents."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.free, self.pinned, self.reserved, self.gone = capacity, [], {}, 0, []

    def evict(self) -> None:
        excess = min(len(self.free) + len(self.pinned) + self.reserved - self.capacity, len(self.free))
        for _ in range(max(0, excess)):
            self.gone.append(self.free.pop(0))

    def insert(self, blocks: list[int]) -> list[int]:
        added = []
        for h in reversed(blocks):
            if h in self.free:
                self.free.remove(h)
                self.free.append(h)
            elif h not in self.pinned:
                self.free.append(h)
                added.append(h)
        self.evict()
        return added

    def remove(self, blocks: list[int]) -> int:
        n = 0
        for h in blocks:
            if h in self.free:
                self.free.remove(h)
                self.gone.append(h)
                n += 1
        return n

    def pin(self, blocks: list[int], extra: int) -> bool:
        in_free = sum(1 for h in blocks if h in self.free)
        new = len(blocks) - in_free - sum(1 for h in blocks if h in self.pinned)
        if new + extra > self.capacity - (len(self.free) + len(self.pinned) + self.reserved) + len(self.free) - in_free:
            return False
        for h in blocks:
            if h in self.pinned:
                self.pinned[h] += 1
            else:
                if h in self.free:
                    self.free.remove(h)
                self.pinned[h] = 1
        self.reserved += extra
        self.evict()
        return True

    def unpin(self, blocks: list[int], extra: int) -> None:
        for h in reversed(blocks):
            n = self.pinned.get(h)
            if n is None:
                continue
            if n > 1:
                self.pinned[h] = n - 1
            else:
                del self.pinned[h]
                self.free.append(h)
        self.reserved = max(0, self.reserved - extra)


block = st.integers(0, 30)  # few distinct blocks: refreshes, holes and duplicates are common
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(block, max_size=12)),
    st.tuples(st.just("remove"), st.lists(block, max_size=6)),
    st.tuples(st.just("pin"), st.lists(block, max_size=5), st.integers(0, 2)),
    st.tuples(st.just("unpin"), st.lists(block, max_size=5), st.integers(0, 2)),
    st.tuples(st.just("resize"), st.integers(0, 20)),
    st.tuples(st.just("clear")),
), max_size=40)


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 20), ops, st.booleans())
def test_block_cache_matches_the_list_model(capacity, operations, batch):
    gone: list[int] = []
    c = BlockCache(capacity, on_evict_many=gone.extend) if batch else BlockCache(capacity, on_evict=gone.append)
    m = ModelCache(capacity)
    for op, *args in operations:
        if op == "insert":
            assert c.insert(args[0]) == m.insert(args[0])
        elif op == "remove":
            assert c.remove(args[0]) == m.remove(args[0])
        elif op == "pin":
            assert c.pin(args[0], args[1]) == m.pin(args[0], args[1])
        elif op == "unpin":
            c.unpin(args[0], args[1])
            m.unpin(args[0], args[1])
        elif op == "resize":
            c.resize(args[0])
            m.capacity = args[0]
            m.evict()
        else:
            c.clear()
            m.gone.extend(m.free)
            m.free = []
        assert c.lru_order() == m.free and c._pinned == m.pinned and c.reserved == m.reserved
        assert gone == m.gone


index_ops = st.lists(st.one_of(
    st.tuples(st.just("record"), st.sampled_from("abcd"), st.integers(0, 3), st.integers(0, 25)),
    st.tuples(st.just("forget"), st.sampled_from("abcd"), st.integers(0, 3), st.integers(0, 25)),
    st.tuples(st.just("resize"), st.sampled_from("abcd"), st.integers(0, 40)),
    st.tuples(st.just("remove"), st.sampled_from("abcd")),
    st.tuples(st.just("add"), st.sampled_from("abcd"), st.integers(0, 40)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(STORES), st.integers(1, 120), index_ops)
def test_prefix_index_owner_bits_follow_the_caches(store, max_entries, operations):
    """A block's owner mask has exactly the bits of the instances whose cache holds it; no empty masks."""
    chains = [list(range(1000 * c, 1000 * c + 25)) for c in range(3)] + [list(range(24, -1, -1))]  # 3 shares 0's
    idx = store(max_entries)
    for name in "ab":
        idx.add_instance(name, 30)
    for op in operations:
        apply_op(idx, chains, *op)
        expected: dict[int, int] = {}
        for n, slot in idx._slot.items():
            for h in idx.lru_order(n):
                expected[h] = expected.get(h, 0) | 1 << slot
        assert idx.owner_masks() == expected
