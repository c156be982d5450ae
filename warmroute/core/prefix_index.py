"""The prefix index: the router's estimate of which blocks each instance's KV cache holds.

One modelled LRU cache per instance at that instance's capacity; a shared map from block hash to a bitmask of
instances answers "who holds this block" with one lookup. Because each modelled cache holds only whole
prefixes (see BlockCache), the set of holders can only shrink along a chain, so the longest match of every
instance is found by bisection: O(changes × log blocks) lookups instead of one per block — a 32,000-character
prompt has 500 blocks.

Memory is bounded: the total number of entries across instances never exceeds `max_entries` (derived from a
byte budget by the caller, at the store's `bytes_per_entry`); each instance's share is min(its KV capacity,
max_entries / instances).

Two stores, the same results: `PythonPrefixIndex` (a BlockCache per instance, dicts of Python ints) and
`CompiledPrefixIndex` (`_index.c`: open-addressing tables and LRU lists, a quarter of the memory and faster to
record; sizes and timings in docs/tuning.md). `PrefixIndex` is the compiled one
where the extension was built; tests/core/test_prefix_index.py runs both and compares them operation by operation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import repeat

from warmroute.core.block_cache import BlockCache


class _Membership:
    """Instance names, their slots (bit positions) and capacities: what both stores keep alike."""

    bytes_per_entry: int  # the most memory one entry takes, tables' growth included (turns a byte cap into entries)

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._slot: dict[str, int] = {}  # instance name -> its slot (bit 1 << slot in owner masks)
        self._wanted: dict[str, int] = {}  # configured capacity (blocks) per instance
        self._capacity: dict[str, int] = {}  # what the index keeps: the wanted capacity within the memory share

    def add_instance(self, name: str, capacity_blocks: int) -> None:
        if name not in self._slot:
            taken = set(self._slot.values())
            self._slot[name] = next(i for i in range(len(taken) + 1) if i not in taken)
            self._created(name, self._slot[name])
        self._wanted[name] = capacity_blocks
        self._rebalance()

    def resize_instance(self, name: str, capacity_blocks: int) -> None:
        """A new estimate of one instance's capacity (engine feedback); shrinking evicts its LRU entries."""
        if name in self._slot:
            self._wanted[name] = capacity_blocks
            self._resize(name, min(capacity_blocks, self.max_entries // len(self._slot)))

    def capacity(self, name: str) -> int:
        """Blocks the index keeps for this instance (its estimated capacity within the memory share)."""
        return self._capacity.get(name, 0)

    def remove_instance(self, name: str) -> None:
        if name not in self._slot:
            return
        self._removed(name, self._slot.pop(name))
        del self._wanted[name], self._capacity[name]
        self._rebalance()

    def clear_instance(self, name: str) -> None:
        """The instance dropped its whole cache (a prefix-cache reset, vLLM's AllBlocksCleared): forget it all."""
        if name in self._slot:
            wanted = self._wanted[name]
            self.remove_instance(name)
            self.add_instance(name, wanted)

    def _rebalance(self) -> None:
        share = self.max_entries // max(1, len(self._slot))
        for name in self._slot:
            self._resize(name, min(self._wanted[name], share))

    def _resize(self, name: str, capacity: int) -> None:
        self._capacity[name] = capacity
        self._set_capacity(name, capacity)

    def estimated_bytes(self) -> int:
        return self.entries() * self.bytes_per_entry

    # what each store implements
    def _created(self, name: str, slot: int) -> None: ...
    def _removed(self, name: str, slot: int) -> None: ...
    def _set_capacity(self, name: str, capacity: int) -> None: ...
    def entries(self, name: str | None = None) -> int: ...


class PythonPrefixIndex(_Membership):
    """The store in Python: a BlockCache per instance and a dict of owner bitmasks."""

    # One indexed block at its peak under churn, not at steady state, so a full index stays within its byte cap:
    # the OrderedDict entry in the instance's cache, its share of the bitmask dict, the hash int itself, and the
    # transient of a dict resizing while full (measurements: docs/tuning.md; checked by
    # tests/core/test_prefix_index.py::test_memory_per_entry_estimate and tests/reliability/test_reliability_state.py).
    bytes_per_entry = 400

    def __init__(self, max_entries: int) -> None:
        super().__init__(max_entries)
        self._owners: dict[int, int] = {}  # block hash -> bitmask of instance slots
        self._caches: dict[str, BlockCache] = {}
        self._names: dict[int, str] = {}  # bit (1 << slot) -> instance name

    # -- membership --------------------------------------------------------------------------------------
    def _created(self, name: str, slot: int) -> None:
        bit = 1 << slot
        self._names[bit] = name
        self._caches[name] = BlockCache(0, on_evict_many=lambda blocks, b=bit: self._drop_owner(blocks, b))

    def _removed(self, name: str, slot: int) -> None:
        self._caches.pop(name).clear()
        del self._names[1 << slot]

    def _set_capacity(self, name: str, capacity: int) -> None:
        self._caches[name].resize(capacity)

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
        bit, owners = 1 << self._slot[name], self._owners
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
        slot = self._slot.get(name)
        return slot is not None and bool(self._owners.get(block, 0) & 1 << slot)

    def entries(self, name: str | None = None) -> int:
        if name is not None:
            return len(self._caches[name]) if name in self._caches else 0
        return sum(len(c) for c in self._caches.values())

    def lru_order(self, name: str) -> list[int]:
        """The instance's blocks, least recently used first (tests)."""
        return self._caches[name].lru_order()

    def owner_masks(self) -> dict[int, int]:
        """Every block's owner bitmask (tests)."""
        return dict(self._owners)

    def __len__(self) -> int:
        return len(self._owners)


class CompiledPrefixIndex(_Membership):
    """The store in C (`_index.c`): the same state and results as PythonPrefixIndex, in a fraction of its memory
    and time. Block hashes must be 64-bit ints (block_hash makes nothing else)."""

    # The peak of one entry under churn, tables' doubling included (tracemalloc sees the C allocations), checked by
    # tests/core/test_prefix_index.py::test_memory_per_entry_estimate and tests/reliability/test_reliability_state.py.
    bytes_per_entry = 144

    def __init__(self, max_entries: int) -> None:
        super().__init__(max_entries)
        self._store = _index.Index()
        self._names: list[str | None] = []  # slot -> instance name (None: free), what match() reports

    def _created(self, name: str, slot: int) -> None:
        self._names += [None] * (slot + 1 - len(self._names))
        self._names[slot] = name
        self._store.set_capacity(slot, 0)

    def _removed(self, name: str, slot: int) -> None:
        self._store.release(slot)
        self._names[slot] = None

    def _set_capacity(self, name: str, capacity: int) -> None:
        self._store.set_capacity(self._slot[name], capacity)

    def record(self, name: str, blocks: Sequence[int]) -> None:
        """The instance now holds this chain (it was just routed there)."""
        slot = self._slot.get(name)
        if slot is not None and blocks:
            self._store.record(slot, blocks)

    def forget(self, name: str, blocks: Sequence[int]) -> int:
        """The instance does not hold these blocks after all (engine feedback). Returns entries removed."""
        slot = self._slot.get(name)
        return self._store.forget(slot, blocks) if slot is not None else 0

    def match_depths(self, blocks: Sequence[int]) -> dict[str, int]:
        """Longest cached prefix, in blocks, of every instance that holds at least the first block."""
        return self._store.match(blocks, self._names)

    def holds(self, name: str, block: int) -> bool:
        slot = self._slot.get(name)
        return slot is not None and self._store.holds(slot, block)

    def entries(self, name: str | None = None) -> int:
        if name is not None:
            slot = self._slot.get(name)
            return self._store.entries(slot) if slot is not None else 0
        return self._store.entries()

    def estimated_bytes(self) -> int:
        """Bytes the C store has allocated (its tables at their current size): exact, not an estimate."""
        return self._store.nbytes()

    def lru_order(self, name: str) -> list[int]:
        """The instance's blocks, least recently used first (tests)."""
        return self._store.lru_order(self._slot[name])

    def owner_masks(self) -> dict[int, int]:
        """Every block's owner bitmask (tests)."""
        return self._store.owners()

    def __len__(self) -> int:
        return self._store.distinct()


try:
    if os.environ.get("WARMROUTE_PURE_PYTHON") == "1":  # to run (and test) the fallback where the C one exists
        raise ImportError("WARMROUTE_PURE_PYTHON=1")
    from warmroute.core import _index
except ImportError:
    _index = None

PrefixIndex: type[PythonPrefixIndex] | type[CompiledPrefixIndex] = (
    CompiledPrefixIndex if _index is not None else PythonPrefixIndex)
NATIVE = _index is not None  # whether the compiled store is in use (logged at start-up)
STORES: list[type[PythonPrefixIndex] | type[CompiledPrefixIndex]] = [PythonPrefixIndex] + (
    [CompiledPrefixIndex] if NATIVE else [])  # what tests compare
BYTES_PER_ENTRY = PrefixIndex.bytes_per_entry
