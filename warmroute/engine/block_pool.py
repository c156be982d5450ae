"""The emulated engine's paged KV cache: a fixed pool of blocks, managed as vLLM V1's BlockPool manages it.

  * Every block is a physical slot of `block_size` tokens with a reference count (the running sequences
    using it) and, once it holds a full computed prompt block, that block's hash.
  * Blocks nobody uses sit in one free queue, least recently freed first; a cached block in it stays
    findable by its hash until the slot is handed out again, which is what evicts it. The queue does not
    prefer empty slots over cached ones: like vLLM, a new allocation takes whatever is at its front.
  * A sequence frees its blocks tail first, so a prompt's last blocks are evicted before its first ones and
    a cached chain keeps its head longest.
  * A prefix hit is the leading run of the prompt's block hashes found in the pool. Two sequences that
    computed the same block at once both keep their copy under that hash (as vLLM does); a lookup takes
    either.

Block hashes are opaque here (the HTTP engine passes `kv_hash.block_hashes` digests; the simulator its own
ints), so the pool never depends on how they were made.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import islice


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Hashable | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash!r})"


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[Hashable], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block")
        self.num_blocks = num_blocks
        self.on_evict = on_evict  # told each hash that leaves the cache (its last copy evicted): KV events
        self._free: OrderedDict[int, KVBlock] = OrderedDict((i, KVBlock(i)) for i in range(num_blocks))
        self._cached: dict[Hashable, dict[int, KVBlock]] = {}  # hash -> its blocks (usually one)

    # -- reading ---------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached blocks in the free queue count as free, as in vLLM)."""
        return 1.0 - len(self._free) / self.num_blocks

    def __contains__(self, block_hash: Hashable) -> bool:
        return block_hash in self._cached

    def __len__(self) -> int:
        """Cached blocks (in use or evictable)."""
        return sum(len(blocks) for blocks in self._cached.values())

    def cached_prefix(self, block_hashes: Sequence[Hashable], limit: int | None = None) -> list[KVBlock]:
        """The blocks of the longest cached leading run of the chain (at most `limit` of them)."""
        cached = self._cached
        found = []
        for h in islice(block_hashes, limit):
            blocks = cached.get(h)
            if blocks is None:
                break
            found.append(next(iter(blocks.values())))
        return found

    def match(self, block_hashes: Sequence[Hashable]) -> int:
        """How many leading blocks of the chain are cached."""
        cached = self._cached
        for i, h in enumerate(block_hashes):
            if h not in cached:
                return i
        return len(block_hashes)

    def lru_order(self) -> list[Hashable]:
        """Hashes of the evictable cached blocks, next to be evicted first (for tests and debugging)."""
        return [b.block_hash for b in self._free.values() if b.block_hash is not None]

    def can_allocate(self, hits: Sequence[KVBlock], new_blocks: int) -> bool:
        """Could a sequence take these cached blocks and `new_blocks` fresh ones now?"""
        # Cached hits still in the free queue leave it when taken, so they are not there to hand out.
        return new_blocks <= len(self._free) - sum(1 for b in hits if b.ref_cnt == 0)

    # -- writing ---------------------------------------------------------------------------------------------
    def take(self, hits: Iterable[KVBlock]) -> None:
        """Hold cached blocks for one more sequence (out of the free queue if nobody held them)."""
        free = self._free
        for b in hits:
            if b.ref_cnt == 0:
                del free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """n blocks from the front of the free queue, evicting what they cached. ValueError if too few."""
        if n > len(self._free):
            raise ValueError(f"{n} blocks asked, {len(self._free)} free")
        pop = self._free.popitem
        out = []
        for _ in range(n):
            b = pop(last=False)[1]
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def cache(self, block: KVBlock, block_hash: Hashable) -> None:
        """Record that `block` now holds the full computed block `block_hash` (visible to later lookups)."""
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} already holds a cached block")
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, {})[block.block_id] = block

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Release one sequence's hold on each block, in eviction order (vLLM passes them tail first)."""
        free = self._free
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                free[b.block_id] = b

    def _evict(self, block: KVBlock) -> None:
        blocks = self._cached[block.block_hash]
        del blocks[block.block_id]
        if not blocks:
            del self._cached[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_hash)
        block.block_hash = None
