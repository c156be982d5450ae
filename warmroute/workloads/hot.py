"""One hot prompt taking most of the traffic (share `hot`), the rest from a Zipf pool of system prompts.

The skew that pins a naive prefix router's traffic to one instance: the router must spread it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from warmroute.workloads.pool import TextPool
from warmroute.workloads.request import Session
from warmroute.workloads.shared import SharedPrompts


@dataclass
class HotPrompt(SharedPrompts):
    name: ClassVar[str] = "hot"
    hot: float = 0.6  # share of requests that carry the hot prompt

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.hot <= 1:
            raise ValueError("hot must be between 0 and 1")

    @cached_property
    def hot_prompt(self) -> str:
        return TextPool(self.seed, "hot prompt", 1, self.system_tokens, 1.0).text(0)

    def session(self, rng: random.Random, index: int) -> Session:
        if rng.random() < self.hot:
            return self.single(rng, index, self.hot_prompt, "hot")
        return self.single(rng, index, self.pool.text(self.pool.draw(rng)), "shared")

    def working_set_tokens(self, concurrency: int = 1) -> int:
        return self.system_tokens + (self.pool.total_tokens if self.hot < 1 else 0)
