"""The prefix-cache model: which full KV blocks a server holds, by chained block hash.

One class serves three users, so they cannot drift apart:
  * the emulated engine (pins the blocks of running sequences, as vLLM's block manager does),
  * the router's prefix index (one BlockCache per instance, no pins: an estimate of the engine's cache),
  * the simulator (through the engine model).

Eviction is LRU over unpinned blocks. Chains are touched tail-first, so a parent block is always at least
as recent as its children and is evicted after them: a cached chain is always a prefix, never a hole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class BlockCache:
    def __init__(self, capacity_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity = capacity_blocks
        self.on_evict = on_evict
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
        free, pinned = self._free, self._pinned
        added = []
        for h in reversed(blocks):  # tail first: the head ends up most recent
            if h in free:
                free.move_to_end(h)
            elif h not in pinned:
                free[h] = None
                added.append(h)
        self._evict_to(self.capacity)
        return added

    def remove(self, blocks: Sequence[int]) -> int:
        """Forget these blocks (a predicted hit the engine did not have). Returns blocks removed."""
        removed = 0
        for h in blocks:
            if h in self._free:
                self._drop(h)
                removed += 1
        return removed

    def clear(self) -> None:
        for h in list(self._free):
            self._drop(h)

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
        free, on_evict = self._free, self.on_evict
        excess = min(len(free) + len(self._pinned) + self.reserved - capacity, len(free))
        for _ in range(excess):
            h, _ = free.popitem(last=False)
            if on_evict is not None:
                on_evict(h)

    def _drop(self, h: int) -> None:
        if self._free.pop(h, 0) is None and self.on_evict is not None:
            self.on_evict(h)
