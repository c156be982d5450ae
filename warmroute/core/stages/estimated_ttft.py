"""Scorer: the estimated time to first token on each instance, (prefill queued there + α × this request's
uncached tokens there) / its prefill rate; queued prefill includes what the engine reports beyond this
router's books (other routers' waiting requests, a prompt that does not fit its free KV cache)."""

from __future__ import annotations

from warmroute.core.decision import OVERLOAD_SPILL
from warmroute.core.engine_load import backlog_tokens
from warmroute.core.fleet import Instance
from warmroute.core.pipeline import Request, Scorer


def queued_prefill(i: Instance, prompt: int, mean_uncached: float) -> float:
    """Prompt tokens `i` computes before a new request's: its queued prefill, and the engine's reported backlog."""
    if i.engine is None:
        return i.queued_prefill_tokens
    return i.queued_prefill_tokens + backlog_tokens(i.engine, prompt, i.kv_capacity_tokens, mean_uncached)


def ttft_s(i: Instance, uncached_tokens: int, prompt: int, mean_uncached: float) -> float:
    """The estimated seconds to a request's first token at `i`, `uncached_tokens` of its prompt computed there."""
    return (queued_prefill(i, prompt, mean_uncached) + uncached_tokens) / i.prefill_tokens_per_s


class EstimatedTtft(Scorer):
    name = "estimated_ttft"

    def score(self, req: Request, candidates: list[Instance]) -> list[float]:
        get, miss_all, prompt, mean = req.miss.get, req.miss_all, req.prompt, req.fleet.mean_uncached_tokens
        return [(queued_prefill(i, prompt, mean) + get(i.name, miss_all)) / i.prefill_tokens_per_s
                for i in candidates]

    def explain(self, req: Request, chosen: Instance) -> str | None:
        return OVERLOAD_SPILL  # a holder's queue (or the guard) made another instance sooner
