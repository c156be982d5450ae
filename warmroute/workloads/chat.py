"""Multi-turn chats: each session is a conversation whose history grows turn by turn.

Assistant replies in the history are synthetic and deterministic, so the next turn's prompt never depends on
what the server answered and a run is reproducible. Turns of a session must be issued in order, each after
the previous one completed (see `Session`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from warmroute.workloads.base import Workload
from warmroute.workloads.pool import TextPool
from warmroute.workloads.request import Session, chat_request
from warmroute.workloads.text import chars_for, filler


@dataclass
class MultiTurn(Workload):
    name: ClassVar[str] = "chat"
    systems: int = 16  # distinct system prompts (Zipf)
    system_tokens: int = 200
    min_turns: int = 4
    max_turns: int = 10
    user_tokens: int = 60
    reply_tokens: int = 250  # synthetic assistant reply kept in the history
    zipf: float = 0.5
    at_least_one: ClassVar[tuple[str, ...]] = (*Workload.at_least_one, "systems", "min_turns")

    def validate(self) -> None:
        super().validate()
        if self.max_turns < self.min_turns:
            raise ValueError("max_turns must be >= min_turns")

    @cached_property
    def system_pool(self) -> TextPool:
        return TextPool(self.seed, "chat system prompt", self.systems, self.system_tokens, self.zipf)

    def session(self, rng: random.Random, index: int) -> Session:
        sid = f"{self.name}-{index}"
        messages = [{"role": "system", "content": self.system_pool.text(self.system_pool.draw(rng))}]
        requests = []
        for turn in range(rng.randint(self.min_turns, self.max_turns)):
            messages.append({"role": "user", "content": self.question(rng, f"{sid}.{turn}", self.user_tokens)})
            requests.append(chat_request(self.model, list(messages), tag=self.name, session=sid,
                                         max_tokens=self.max_tokens, turn=turn))
            messages.append({"role": "assistant", "content": filler(rng, chars_for(self.reply_tokens))})
        return Session(sid, tuple(requests))

    def mean_requests_per_session(self) -> float:
        return (self.min_turns + self.max_turns) / 2

    def working_set_tokens(self, concurrency: int = 1) -> int:
        # Each live conversation holds its history; on average it is about half its final length.
        history = self.mean_requests_per_session() * (self.user_tokens + self.reply_tokens) / 2
        return self.system_pool.total_tokens + int(concurrency * history)
