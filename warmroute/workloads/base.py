"""The workload interface: a seeded, endless (or, for traces, finite) stream of sessions.

Workloads are pure: no clock, no I/O (trace replay reads its file once, when built). `sessions()` restarts
from the seed on every call, so two runs with the same seed issue the same requests in the same order.
"""

from __future__ import annotations

import dataclasses
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from typing import ClassVar

from warmroute.workloads.request import Session, WorkloadRequest
from warmroute.workloads.text import chars_for, filler, rng_for

DEFAULT_MODEL = "warmroute-emulated"


@dataclass
class Workload(ABC):
    name: ClassVar[str]
    seed: int = 0
    model: str = DEFAULT_MODEL
    max_tokens: int = 32  # output tokens per request
    # Parameters that count something the workload cannot do without (each must be >= 1).
    at_least_one: ClassVar[tuple[str, ...]] = ("max_tokens",)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{f.name} must be >= 0")
        self.validate()

    def validate(self) -> None:
        """Check the workload's own constraints (ValueError naming the parameter); sizes are already >= 0."""
        for name in self.at_least_one:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    def sessions(self) -> Iterator[Session]:
        rng = rng_for(self.seed, self.name, "stream")
        for index in count():
            yield self.session(rng, index)

    def requests(self) -> Iterator[WorkloadRequest]:
        """Every request in session order (for drivers that do not need turn ordering)."""
        for session in self.sessions():
            yield from session.requests

    def session(self, rng: random.Random, index: int) -> Session:
        """The `index`-th session, drawing its choices from `rng` (the stream's RNG). Workloads that
        override `sessions()` instead (mixtures, traces) need not define it."""
        raise NotImplementedError

    @abstractmethod
    def working_set_tokens(self, concurrency: int = 1) -> int:
        """Tokens of prefix content worth caching (what the fleet's caches compete for), given how many
        sessions run at once (only conversation histories depend on it)."""

    def mean_requests_per_session(self) -> float:
        return 1.0

    def question(self, rng: random.Random, request_id: str, tokens: int) -> str:
        """A short user question that starts with the request's id, so no two requests' tails are equal."""
        head = f"Request {request_id}: "
        return head + filler(rng, max(0, chars_for(tokens) - len(head)))
