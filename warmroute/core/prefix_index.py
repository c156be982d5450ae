"""The prefix index: the router's estimate of which blocks each instance's KV cache holds.

One `BlockCache` per instance models that instance's LRU cache at its capacity; a shared map from block hash
to a bitmask of instances answers "who holds this block" with one dictionary lookup. Because each modelled
cache holds only whole prefixes (see BlockCache), the set of holders can only shrink along a chain, so the
longest match of every instance is found by bisection: O(changes × log blocks) lookups instead of one per
block — a 32,000-character prompt has 500 blocks.

Memory is bounded: the total number of entries across instances never exceeds `max_entries` (derived from a
byte budget by the caller); each instance's share is min(its KV capacity, max_entries / instances).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from warmroute.core.block_cache import BlockCache

# Measured cost of one indexed block at its peak under churn: the OrderedDict entry in the instance's cache,
# its share of the bitmask dict, the hash int itself, and the transient of a dict resizing while full
# (tracemalloc peaks of 270-390 bytes per entry from 4k to 250k entries); see
# tests/test_prefix_index.py::test_memory_per_entry_estimate and tests/test_reliability_state.py. (220, the
# steady-state figure without churn, let a full index peak at 1.4x its byte cap.)
BYTES_PER_ENTRY = 400


class PrefixIndex:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._owners: dict[int, int] = {}  # block hash -> bitmask of instance slots
        self._caches: dict[str, BlockCache] = {}
        self._bit: dict[str, int] = {}  # instance name -> its bit
        self._names: dict[int, str] = {}  # bit -> instance name
        self._wanted: dict[str, int] = {}  # configured capacity (blocks) per instance

    # -- membership --------------------------------------------------------------------------------------
    def add_instance(self, name: str, capacity_blocks: int) -> None:
        if name in self._caches:
            self._wanted[name] = capacity_blocks
            self._rebalance()
            return
        bit = 1 << next(i for i in range(len(self._bit) + 1) if (1 << i) not in self._names)
        self._bit[name], self._names[bit] = bit, name
        self._caches[name] = BlockCache(0, on_evict_many=lambda blocks, b=bit: self._drop_owner(blocks, b))
        self._wanted[name] = capacity_blocks
        self._rebalance()

    def resize_instance(self, name: str, capacity_blocks: int) -> None:
        """A new estimate of one instance's capacity (engine feedback); shrinking evicts its LRU entries."""
        if name in self._caches:
            self._wanted[name] = capacity_blocks
            self._caches[name].resize(min(capacity_blocks, self.max_entries // len(self._caches)))

    def capacity(self, name: str) -> int:
        """Blocks the index keeps for this instance (its estimated capacity within the memory share)."""
        cache = self._caches.get(name)
        return cache.capacity if cache is not None else 0

    def remove_instance(self, name: str) -> None:
        if name not in self._caches:
            return
        self._caches[name].clear()
        bit = self._bit.pop(name)
        del self._names[bit], self._caches[name], self._wanted[name]
        self._rebalance()

    def _rebalance(self) -> None:
        share = self.max_entries // max(1, len(self._caches))
        for name, cache in self._caches.items():
            cache.resize(min(self._wanted[name], share))

    def _drop_owner(self, blocks: list[int], bit: int) -> None:
        """These blocks left the instance with this bit: clear it, and forget blocks nobody else holds."""
        owners = self._owners
        # Usually the instance was a block's only holder: pop them all in one C loop, then put back the rest.
        masks = list(map(owners.pop, blocks, repeat(0)))
        if masks.count(bit) != len(masks):
            for h, mask in zip(blocks, masks):
                if mask & ~bit:
                    owners[h] = mask & ~bit

    # -- updates ------------------------------------------------------------------------------------------
    def record(self, name: str, blocks: Sequence[int]) -> None:
        """The instance now holds this chain (it was just routed there)."""
        cache = self._caches.get(name)
        if cache is None or not blocks:
            return
        bit, owners = self._bit[name], self._owners
        added = cache.touch(blocks)  # only new blocks need the bit; refreshed ones have it
        # Usually nobody else holds a new block: setdefault stores the bit in one step (C loop); a mask that
        # comes back different belongs to other instances and gets this bit added.
        masks = list(map(owners.setdefault, added, repeat(bit)))
        if masks.count(bit) != len(masks):
            for h, mask in zip(added, masks):
                if mask != bit:
                    owners[h] = mask | bit
        # Evicting past capacity clears the bit again (_drop_owner), also from new blocks of a chain longer
        # than the whole cache: it keeps only its head.
        cache.trim()

    def forget(self, name: str, blocks: Sequence[int]) -> int:
        """The instance does not hold these blocks after all (engine feedback). Returns entries removed."""
        cache = self._caches.get(name)
        return cache.remove(blocks) if cache is not None else 0

    # -- queries ------------------------------------------------------------------------------------------
    def match_depths(self, blocks: Sequence[int]) -> dict[str, int]:
        """Longest cached prefix, in blocks, of every instance that holds at least the first block."""
        n = len(blocks)
        get = self._owners.get
        first = get(blocks[0], 0) if n else 0
        if not first:
            return {}
        depths: dict[str, int] = {}
        # Each interval (lo, hi) has mask(lo) known and mask(hi) known, mask(n) = 0; holders only shrink.
        stack = [(0, first, n, 0)]
        while stack:
            lo, mlo, hi, mhi = stack.pop()
            if mlo == mhi:
                continue
            if hi - lo == 1:
                dropped = mlo & ~mhi
                while dropped:
                    bit = dropped & -dropped
                    name = self._names.get(bit)
                    if name is not None:
                        depths[name] = lo + 1
                    dropped ^= bit
                continue
            mid = (lo + hi) // 2
            mmid = get(blocks[mid], 0) & mlo  # & mlo keeps the bisection exact if a chain has a hole
            stack.append((lo, mlo, mid, mmid))
            stack.append((mid, mmid, hi, mhi))
        return depths

    def holds(self, name: str, block: int) -> bool:
        return bool(self._owners.get(block, 0) & self._bit.get(name, 0))

    def entries(self, name: str | None = None) -> int:
        if name is not None:
            return len(self._caches[name]) if name in self._caches else 0
        return sum(len(c) for c in self._caches.values())

    def estimated_bytes(self) -> int:
        return self.entries() * BYTES_PER_ENTRY

    def __len__(self) -> int:
        return len(self._owners)
