"""The exact index: which token blocks each instance says it holds (its KV-cache events); no I/O.

Blocks are keyed by OUR chained hash of the event's token ids (core/block_hash.py over the ids packed 4 bytes
each, seeded by LoRA name and cache salt), never by the engine's hash: engines seed theirs per process, so two
instances holding the same prefix report different hashes, and a request could never be matched against them.
The engine's hash is kept only to resolve the parent of a later BlockStored and the blocks of a BlockRemoved.

Between a decision and the engine's event (the prefill takes a while) the chosen instance gets speculative
entries for the request's blocks that expire after `speculative_ttl` seconds, so a burst of requests sharing a
new prefix follows the first one instead of scattering (llm-d does the same).

Memory is bounded: each instance keeps at most `max_blocks` reported blocks (the oldest reported are dropped
first; a real engine never holds more than its KV cache) and `max_blocks` speculative ones.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from warmroute.core.block_hash import block_hashes, extend_chain, seed_of
from warmroute.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event

if TYPE_CHECKING:
    from warmroute.core.routing_key import RoutingKey

TOKEN_BYTES = 4  # token ids are packed as little-endian uint32 before hashing
BYTES_PER_BLOCK = 200  # rough cost of one indexed block (two dict entries and a tuple), to size max_blocks


def token_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The seed of a token chain: what must never share a cache inside one engine (LoRA adapter, cache salt)."""
    return seed_of("tokens", lora_name or "", cache_salt or "")


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def token_chain(data: bytes, seed: int, block_size: int) -> Sequence[int]:
    """Our chained hashes of the full blocks of packed token ids (`data`), `block_size` tokens a block."""
    return block_hashes(data, seed, block_size * TOKEN_BYTES)


@dataclass(slots=True)
class InstanceBlocks:
    """One instance's reported blocks."""

    block_size: int = 0  # tokens a block: the largest its events reported (0: nothing reported yet)
    by_engine: dict[int, tuple[int, int]] = field(default_factory=dict)  # engine hash -> (our hash, depth)
    ours: dict[int, int] = field(default_factory=dict)  # our hash -> how many engine blocks have it
    speculative: dict[int, float] = field(default_factory=dict)  # our hash -> expiry (monotonic seconds)
    orphans: int = 0  # stored blocks whose parent was never reported (they cannot be hashed: not indexed)
    dropped: int = 0  # reported blocks dropped to stay within max_blocks
    partial: int = 0  # stored events of blocks smaller than the instance's block size (not indexed)

    def holds(self, block: int, now: float) -> bool:
        if block in self.ours:
            return True
        expiry = self.speculative.get(block)
        return expiry is not None and expiry > now


class ExactIndex:
    def __init__(self, max_blocks: int = 1_000_000, speculative_ttl: float = 2.0) -> None:
        self.max_blocks = max(1, max_blocks)
        self.speculative_ttl = speculative_ttl
        self.instances: dict[str, InstanceBlocks] = {}
        # The instances whose events are in step with their engine (the subscribers say): only their blocks are
        # trusted; the others are routed by the approximate model.
        self.fresh: set[str] = set()
        self.now = 0.0  # the shell's clock (monotonic seconds), set before each decision: speculation expires by it

    # -- membership ---------------------------------------------------------------------------------------
    def add_instance(self, name: str) -> InstanceBlocks:
        return self.instances.setdefault(name, InstanceBlocks())

    def remove_instance(self, name: str) -> None:
        self.instances.pop(name, None)
        self.fresh.discard(name)

    def clear(self, name: str) -> None:
        """Forget everything an instance reported (its cache was cleared, or its stream restarted)."""
        if name in self.instances:
            self.instances[name] = InstanceBlocks(self.instances[name].block_size)

    # -- events -------------------------------------------------------------------------------------------
    def apply(self, name: str, events: Iterable[Event]) -> int:
        """Apply one batch of an instance's events; returns how many changed the index."""
        blocks = self.instances.get(name)
        if blocks is None:
            return 0
        applied = 0
        for event in events:
            if isinstance(event, BlockStored):
                applied += self._stored(blocks, event)
            elif isinstance(event, BlockRemoved):
                applied += self._removed(blocks, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(name)
                blocks = self.instances[name]
                applied += 1
        return applied

    def _stored(self, blocks: InstanceBlocks, event: BlockStored) -> int:
        if blocks.block_size != event.block_size:
            if event.block_size < blocks.block_size:  # a partial block (vLLM reports some before they fill)
                blocks.partial += 1
                return 0
            blocks.by_engine.clear()  # larger blocks than before: the first were partial ones
            blocks.ours.clear()
            blocks.block_size = event.block_size
        data = pack_tokens(event.token_ids)
        if event.parent_block_hash is None:
            ours = token_chain(data, token_seed(event.lora_name, event.cache_salt), event.block_size)
            depth = 0
        else:
            parent = blocks.by_engine.get(event.parent_block_hash)
            if parent is None:
                blocks.orphans += len(event.block_hashes)
                return 0
            depth = parent[1] + 1
            ours = extend_chain(parent[0], depth, data, event.block_size * TOKEN_BYTES)
        for i, (engine_hash, our_hash) in enumerate(zip(event.block_hashes, ours)):
            if engine_hash in blocks.by_engine:
                continue  # vLLM reports a prefix-cache hit's blocks as stored again: nothing new
            blocks.by_engine[engine_hash] = (our_hash, depth + i)
            blocks.ours[our_hash] = blocks.ours.get(our_hash, 0) + 1
        self._bound(blocks)
        return 1

    @staticmethod
    def _removed(blocks: InstanceBlocks, engine_hashes: Sequence[int]) -> int:
        changed = 0
        for engine_hash in engine_hashes:
            entry = blocks.by_engine.pop(engine_hash, None)
            if entry is not None:
                changed = 1
                _unref(blocks, entry[0])
        return changed

    def _bound(self, blocks: InstanceBlocks) -> None:
        while len(blocks.by_engine) > self.max_blocks:
            oldest = next(iter(blocks.by_engine))
            _unref(blocks, blocks.by_engine.pop(oldest)[0])
            blocks.dropped += 1

    # -- decisions ----------------------------------------------------------------------------------------
    def match_tokens(self, name: str, chain_of, now: float) -> int:
        """Tokens of a prompt's leading full blocks the instance holds. `chain_of(block_size)` gives the prompt's
        chain at the instance's block size (computed once per size by the caller)."""
        blocks = self.instances.get(name)
        if blocks is None or not blocks.block_size or not (blocks.ours or blocks.speculative):
            return 0
        depth = 0
        for h in chain_of(blocks.block_size):
            if not blocks.holds(h, now):
                break
            depth += 1
        return depth * blocks.block_size

    def speculate(self, name: str, chain: Sequence[int], now: float) -> None:
        """The request was sent to `name`: count its blocks as held there until its events arrive (or the TTL)."""
        blocks = self.instances.get(name)
        if blocks is None or not blocks.block_size:
            return
        spec = blocks.speculative
        if len(spec) + len(chain) > self.max_blocks:
            for h in [h for h, t in spec.items() if t <= now]:
                del spec[h]
        expiry = now + self.speculative_ttl
        for h in chain:
            spec.pop(h, None)  # re-inserted at the end: the dict stays in expiry order
            spec[h] = expiry
        while len(spec) > self.max_blocks:
            del spec[next(iter(spec))]

    def size(self, name: str | None = None) -> int:
        """Reported blocks indexed (for one instance, or all)."""
        if name is not None:
            blocks = self.instances.get(name)
            return len(blocks.by_engine) if blocks is not None else 0
        return sum(len(b.by_engine) for b in self.instances.values())


def exact_depths(index: ExactIndex, key: RoutingKey, n_blocks: int,
                 approximate: dict[str, int]) -> tuple[dict[str, int], dict[str, float]]:
    """cache_aware's match depths with the exact index's where an instance is fresh, and for those instances the
    share of the prompt's tokens they hold.

    The strategy counts depth in its own blocks (block_bytes of the routing key, about 16 estimated tokens), so an
    exact match of m of the prompt's t tokens becomes m/t of the key's n blocks: the share matched is the
    index's, the units the strategy's (the decision then states the exact share: Decision.matched_tokens)."""
    tokens = len(key.token_data or b"") // TOKEN_BYTES
    if not index.fresh or not tokens or not n_blocks:
        return approximate, {}
    depths = dict(approximate)
    shares = {}
    for name in index.fresh:
        matched = index.match_tokens(name, key.token_blocks, index.now)
        shares[name] = matched / tokens
        depth = min(n_blocks, matched * n_blocks // tokens)
        if depth:
            depths[name] = depth
        else:  # the engine says it does not hold it, whatever the model guessed
            depths.pop(name, None)
    return depths, shares


def _unref(blocks: InstanceBlocks, our_hash: int) -> None:
    n = blocks.ours.get(our_hash, 0)
    if n <= 1:
        blocks.ours.pop(our_hash, None)
    else:
        blocks.ours[our_hash] = n - 1
