"""Shared system prompts: a pool of long system prompts with Zipf popularity, short unique questions."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from warmroute.workloads.base import Workload
from warmroute.workloads.pool import TextPool
from warmroute.workloads.request import Session, chat_request


@dataclass
class SharedPrompts(Workload):
    name: ClassVar[str] = "shared"
    pool_size: int = 40  # distinct system prompts
    system_tokens: int = 1500
    question_tokens: int = 40
    zipf: float = 0.5  # popularity exponent: rank k has weight 1 / (k + 1) ** zipf
    at_least_one: ClassVar[tuple[str, ...]] = (*Workload.at_least_one, "pool_size")

    @cached_property
    def pool(self) -> TextPool:
        return TextPool(self.seed, "system prompt", self.pool_size, self.system_tokens, self.zipf)

    def session(self, rng: random.Random, index: int) -> Session:
        return self.single(rng, index, self.pool.text(self.pool.draw(rng)), self.name)

    def single(self, rng: random.Random, index: int, system: str, tag: str) -> Session:
        """A one-request session: the given system prompt and a fresh question."""
        sid = f"{self.name}-{index}"
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": self.question(rng, sid, self.question_tokens)},
        ]
        request = chat_request(self.model, messages, tag=tag, session=sid, max_tokens=self.max_tokens)
        return Session(sid, (request,))

    def working_set_tokens(self, concurrency: int = 1) -> int:
        return self.pool.total_tokens
