"""Last picker: the candidate highest in the prefix's rendezvous order, so cold prefixes land where other router
replicas would put them and a hot prefix warms a small, stable set of instances."""

from __future__ import annotations

from warmroute.core.fleet import Instance
from warmroute.core.pipeline import Picker, Request
from warmroute.core.stages.compiled import prefix_hash, top


class RendezvousPick(Picker):
    name = "rendezvous"

    def __init__(self, prefix_length: int) -> None:
        self.prefix_length = prefix_length

    def pick(self, req: Request, candidates: list[Instance]) -> Instance:
        return top(prefix_hash(req.key, self.prefix_length), candidates)
