"""The demo's default: a blend of the synthetic workloads, by share of requests.

    45% shared system prompts (Zipf pool)   25% RAG (Zipf documents)
    25% multi-turn chats                     5% one hot prompt

Each part keeps its own RNG stream (derived from the seed and its name), so changing one share does not
change the text of the others. Shares are of requests, so chats (several turns per session) are picked as
sessions proportionally less often.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from warmroute.workloads.base import Workload
from warmroute.workloads.chat import MultiTurn
from warmroute.workloads.hot import HotPrompt
from warmroute.workloads.rag import Rag
from warmroute.workloads.request import Session
from warmroute.workloads.shared import SharedPrompts
from warmroute.workloads.text import rng_for


@dataclass
class Mixed(Workload):
    name: ClassVar[str] = "mixed"
    shared_share: float = 0.45
    rag_share: float = 0.25
    chat_share: float = 0.25
    hot_share: float = 0.05

    def validate(self) -> None:
        super().validate()
        if not any((self.shared_share, self.rag_share, self.chat_share, self.hot_share)):
            raise ValueError("at least one share must be > 0")

    @cached_property
    def parts(self) -> list[tuple[Workload, float]]:
        """(workload, share of requests) for each part with a positive share."""
        common = {"seed": self.seed, "model": self.model, "max_tokens": self.max_tokens}
        parts: list[tuple[Workload, float]] = [
            (SharedPrompts(**common), self.shared_share),
            (Rag(**common), self.rag_share),
            (MultiTurn(**common), self.chat_share),
            (HotPrompt(**common, hot=1.0), self.hot_share),
        ]
        return [(w, share) for w, share in parts if share > 0]

    def sessions(self) -> Iterator[Session]:
        rng = rng_for(self.seed, self.name, "stream")
        streams = [w.sessions() for w, _ in self.parts]
        weights = [share / w.mean_requests_per_session() for w, share in self.parts]
        while True:
            yield next(rng.choices(streams, weights)[0])

    def mean_requests_per_session(self) -> float:
        weights = [share / w.mean_requests_per_session() for w, share in self.parts]
        return sum(share for _, share in self.parts) / sum(weights)

    def working_set_tokens(self, concurrency: int = 1) -> int:
        total = sum(share for _, share in self.parts)
        # Sessions in flight split among the parts roughly by their share of requests.
        return sum(w.working_set_tokens(max(1, round(concurrency * share / total))) for w, share in self.parts)
