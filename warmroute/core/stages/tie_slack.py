"""Picker step: every candidate within one block's cost of the cheapest is as good (a cold prefix ties everywhere)."""

from __future__ import annotations

from warmroute.core.fleet import Instance
from warmroute.core.pipeline import Picker, Request


class TieSlack(Picker):
    name = "tie_slack"

    def narrow(self, req: Request, candidates: list[Instance], costs: list[float] | None
               ) -> tuple[list[Instance], list[float] | None]:
        if costs is None:
            raise ValueError("tie_slack needs a scorer before it")
        limit = min(costs) + req.alpha * req.block_tokens / min([i.prefill_tokens_per_s for i in candidates])
        kept = [(i, c) for i, c in zip(candidates, costs) if c <= limit]
        return [i for i, _ in kept], [c for _, c in kept]
