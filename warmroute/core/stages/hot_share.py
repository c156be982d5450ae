"""Filter: a hot prefix (its longest match's end on at least 1/N of the recent requests, N routable instances)
skips the instances already sent more than (1+δ) × the mean of recent requests + a slack, unless all were. At a
load where queues stay short the cost alone would keep it on the instances that hold it, however many requests
it brings them; this copies it to more instances instead."""

from __future__ import annotations

from warmroute.core.decision import HOT_SPREAD
from warmroute.core.fleet import RECENT_WINDOW, Instance
from warmroute.core.pipeline import Filter, Request
from warmroute.core.popularity import Popularity


class HotShare(Filter):
    name = "hot_share"

    def __init__(self, factor: float, slack: float) -> None:
        self.factor, self.slack = factor, slack  # slack in requests
        self.popularity = Popularity()  # per deepest matched block: which prefixes are hot

    def prepare(self, req: Request) -> None:
        # Counted per end of the longest match (a hot system prompt's last cached block), never per whole prompt,
        # so a conversation's own history is never hot.
        blocks, n = req.blocks, len(req.up)
        prefix = blocks[min(req.deepest, len(blocks)) - 1] if req.depths and blocks else None
        req.hot = self.popularity.add(prefix, RECENT_WINDOW * n) * n >= 1.0  # its share before this request

    def slack_recent(self, req: Request) -> float:
        """The slack in units of Instance.recent (which fades by rescaling its unit)."""
        return self.slack * req.fleet.recent_unit.value

    def cap(self, req: Request) -> float:
        """The most recent requests an instance may have been sent and still take the hot prefix's next one:
        (1+δ) x the mean over the routable instances + slack. Computed once per request, when first asked."""
        if req.share_cap != req.share_cap:  # NaN: not computed yet
            up = req.up
            req.share_cap = (1 + self.factor) * sum([i.recent for i in up]) / len(up) + self.slack_recent(req)
        return req.share_cap

    def filter(self, req: Request, candidates: list[Instance]) -> list[Instance]:
        if not req.hot:
            return candidates
        cap = self.cap(req)
        return [i for i in candidates if i.recent <= cap] or candidates

    def explain(self, req: Request, chosen: Instance) -> str | None:
        """A holder of the deepest match had had its share: the prefix was copied rather than sent there."""
        if req.hot:
            cap = self.cap(req)
            if any(i.recent > cap for i in req.up if req.depths.get(i.name) == req.deepest):
                return HOT_SPREAD
        return None
