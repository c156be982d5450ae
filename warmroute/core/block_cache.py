"""The prefix-cache model: which full KV blocks a server holds, by chained block hash.

The router's prefix index keeps one BlockCache per instance, without pins: its estimate of that engine's
cache. (The pinning API models a block manager's in-use blocks; the emulated engine has its own, vLLM-like
pool in warmroute/engine/block_pool.py, so that the router's model is tested against one it did not write.)

Eviction is LRU over unpinned blocks. Chains are touched tail-first, so a parent block is always at least
as recent as its children and is evicted after them: a cached chain is always a prefix, never a hole.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import chain


class BlockCache:
    def __init__(self, capacity_blocks: int, on_evict: Callable[[int], None] | None = None,
                 on_evict_many: Callable[[list[int]], None] | None = None) -> None:
        """`on_evict` is called for every block that leaves the cache (evicted, removed or cleared), after it
        has left; `on_evict_many` once per batch of them, in the same order (cheaper than a call per block:
        a cold chain at capacity evicts hundreds)."""
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity = capacity_blocks
        self.on_evict = on_evict
        self.on_evict_many = on_evict_many
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, evictable; least recent first
        self._pinned: dict[int, int] = {}  # cached and in use by running sequences: hash -> refcount
        self.reserved = 0  # blocks held by running sequences outside the prefix cache (decode tokens)

    # -- reading ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._free) + len(self._pinned)

    def __contains__(self, block: int) -> bool:
        return block in self._free or block in self._pinned

    @property
    def used_blocks(self) -> int:
        return len(self) + self.reserved

    @property
    def pinned_blocks(self) -> int:
        return len(self._pinned)

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of the chain are cached."""
        free, pinned = self._free, self._pinned
        for i, h in enumerate(blocks):
            if h not in free and h not in pinned:
                return i
        return len(blocks)

    def lru_order(self) -> list[int]:
        """Evictable blocks, least recently used first (for tests and debugging)."""
        return list(self._free)

    # -- writing without pins (the router's estimate) ----------------------------------------------
    def insert(self, blocks: Sequence[int]) -> list[int]:
        """Cache the chain (or refresh it); evicts LRU blocks past capacity. Returns the blocks added."""
        added = self.touch(blocks)
        self.trim()
        return added

    def touch(self, blocks: Sequence[int]) -> list[int]:
        """insert() without its eviction: the cache may stand over capacity until trim(). (The prefix index
        marks the added blocks' owner in between, so evicting one of them later needs no special case.)"""
        free, pinned = self._free, self._pinned
        to_end = free.move_to_end
        added = []
        todo = reversed(blocks)  # tail first: the head ends up most recent
        for h in todo:  # the uncached tail of the chain
            if h in free:
                to_end(h)
                break
            if h not in pinned:
                free[h] = None
                added.append(h)
        else:
            return added
        # A cached chain is a prefix, so the rest is usually cached too: refresh it in one C loop (map). A
        # block that is not (a hole, or pinned) stops it with a KeyError; the rest then goes one by one.
        try:
            deque(map(to_end, todo), maxlen=0)
            return added
        except KeyError as e:
            todo = chain(e.args[:1], todo)
        for h in todo:
            if h in free:
                to_end(h)
            elif h not in pinned:
                free[h] = None
                added.append(h)
        return added

    def trim(self) -> None:
        """Evict least recently used blocks past capacity."""
        self._evict_to(self.capacity)

    def remove(self, blocks: Sequence[int]) -> int:
        """Forget these blocks (a predicted hit the engine did not have). Returns blocks removed."""
        free = self._free
        removed = []
        for h in blocks:
            if h in free:
                del free[h]
                removed.append(h)
        self._left(removed)
        return len(removed)

    def clear(self) -> None:
        gone = list(self._free)
        self._free.clear()
        self._left(gone)

    def resize(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._evict_to(capacity_blocks)

    # -- writing with pins (the engine's block manager) --------------------------------------------
    def can_pin(self, blocks: Sequence[int], extra_blocks: int = 0) -> bool:
        """Would pinning this chain (plus `extra_blocks` reserved ones) fit without evicting pinned blocks?"""
        free, pinned = self._free, self._pinned
        in_free = sum(1 for h in blocks if h in free)
        new = len(blocks) - in_free - sum(1 for h in blocks if h in pinned)
        # Blocks of this chain that sit in the free list are about to be pinned, so they cannot be evicted.
        reusable = len(free) - in_free
        room = self.capacity - self.used_blocks
        return new + extra_blocks <= room + reusable

    def pin(self, blocks: Sequence[int], extra_blocks: int = 0) -> bool:
        """Hold the chain in the cache for a running sequence; False (and no change) if it cannot fit."""
        if not self.can_pin(blocks, extra_blocks):
            return False
        pinned, free = self._pinned, self._free
        for h in blocks:
            if h in pinned:
                pinned[h] += 1
            else:
                free.pop(h, None)
                pinned[h] = 1
        self.reserved += extra_blocks
        self._evict_to(self.capacity)
        return True

    def unpin(self, blocks: Sequence[int], extra_blocks: int = 0) -> None:
        """Release a finished sequence's chain: its blocks stay cached, evictable, tail first."""
        pinned, free = self._pinned, self._free
        for h in reversed(blocks):
            n = pinned.get(h)
            if n is None:
                continue
            if n > 1:
                pinned[h] = n - 1
            else:
                del pinned[h]
                free[h] = None
        self.reserved = max(0, self.reserved - extra_blocks)

    # -- internals -------------------------------------------------------------------------------------
    def _evict_to(self, capacity: int) -> None:
        free = self._free
        excess = min(len(free) + len(self._pinned) + self.reserved - capacity, len(free))
        if excess > 0:
            pop = free.popitem
            self._left([pop(last=False)[0] for _ in range(excess)])

    def _left(self, blocks: list[int]) -> None:
        """Tell the callbacks that these blocks left the cache."""
        if not blocks:
            return
        if self.on_evict_many is not None:
            self.on_evict_many(blocks)
        if self.on_evict is not None:
            for h in blocks:
                self.on_evict(h)
