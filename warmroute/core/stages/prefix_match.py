"""Facts: how much of the prompt each instance holds, and what a cache miss costs given who holds it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from warmroute.core.decision import CACHE_HIT, COLD, KV_SPILL
from warmroute.core.engine_load import foreign_requests
from warmroute.core.exact_index import ExactIndex, exact_depths
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.pipeline import Facts, Request

# Who holds a prompt's deepest match, which sets the weight of its cache miss.
PRIVATE, SHARED, SWAMPED = "private", "shared", "swamped"

# Cached prefix length in blocks per instance holding any: the router's index, or (the simulator's oracle) the
# engines' real caches.
DepthSource = Callable[[Sequence[int], Fleet], dict[str, int]]


def index_depths(blocks: Sequence[int], fleet: Fleet) -> dict[str, int]:
    return fleet.index.match_depths(blocks)


def kv_pressure(inst: Instance, scale: float = 1.0) -> float:
    """The KV cache the requests in flight at an instance need, over its capacity: this router's books, plus
    other routers' requests where the engine reports them (each the size of this router's there). The books count
    the router's tokens (about 4 bytes each), the capacity the engine's: `scale`, the factor engine feedback learns
    between them (Fleet.cache_scale), puts both in the router's."""
    tokens = inst.inflight_prompt_tokens
    if inst.engine is not None and inst.inflight:
        tokens += foreign_requests(inst.engine) * tokens / inst.inflight
    capacity = inst.kv_capacity_tokens * scale
    return tokens / capacity if capacity > 0 else 0.0


class PrefixMatch(Facts):
    """Sets the request's blocks, depths and miss weight α: `miss_weight` when one instance alone holds its
    deepest match (a conversation's history: moving it recomputes everything and strands the only warm copy),
    `shared_miss_weight` when several or none do (one more copy of a popular prefix spreads its load), and the
    shared weight too when that one instance is swamped past `sticky_kv_limit` (its engine evicts queued
    histories anyway, so staying buys nothing)."""

    name = "prefix_match"

    def __init__(self, miss_weight: float, shared_miss_weight: float, sticky_kv_limit: float,
                 depths: DepthSource = index_depths) -> None:
        self.miss_weight, self.shared_miss_weight = miss_weight, shared_miss_weight
        self.sticky_kv_limit = sticky_kv_limit
        self.depths = depths
        self.exact: ExactIndex | None = None  # precise mode: the engines' own reports, where fresh

    def observe(self, req: Request) -> None:
        blocks = req.blocks = req.key.blocks(req.fleet.settings.block_bytes)
        depths = req.depths = self.depths(blocks, req.fleet) if blocks else {}
        if self.exact is not None:
            req.precise = {}
            if req.key.token_data is not None:
                depths, req.precise = exact_depths(self.exact, req.key, len(blocks), depths)
                req.depths = depths
        req.deepest = max(depths.values()) if depths else 0
        alpha, req.holder = self.miss_weight_for(req)
        req.alpha = alpha
        prompt = req.prompt
        # α x the prompt's uncached tokens: all of them, except on the (few) instances holding its first blocks.
        miss_all = req.miss_all = alpha * prompt
        if depths:  # else no holder: Request.miss's default (empty) stands
            block_tokens = req.block_tokens
            req.miss = {name: alpha * max(0, prompt - depth * block_tokens) if depth else miss_all
                        for name, depth in depths.items()}

    def miss_weight_for(self, req: Request) -> tuple[float, str]:
        depths = req.depths
        if not depths:  # a cold prompt (depths lists holders only, each with at least one block)
            return self.shared_miss_weight, SHARED
        if len(depths) == 1:  # the usual private case (a conversation's history), without a list
            name = next(iter(depths))
        else:
            holders = [n for n, d in depths.items() if d == req.deepest]
            if len(holders) != 1:
                return self.shared_miss_weight, SHARED
            name = holders[0]
        holder = req.fleet.instances.get(name)
        if holder is not None and kv_pressure(holder, req.fleet.cache_scale.value) > self.sticky_kv_limit:
            return self.shared_miss_weight, SWAMPED
        return self.miss_weight, PRIVATE

    def explain(self, req: Request, chosen: Instance) -> str | None:
        if not req.depths:
            return COLD
        if req.depths.get(chosen.name, 0) == req.deepest:
            return CACHE_HIT
        return KV_SPILL if req.holder == SWAMPED else None  # the holder was let go: its miss weighed as shared
