"""Last pickers of the load-only baselines: random and round robin (least loaded is in least_loaded.py)."""

from __future__ import annotations

import random

from warmroute.core.decision import LOAD_BALANCE
from warmroute.core.fleet import Instance
from warmroute.core.pipeline import Picker, Request


class RandomPick(Picker):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, req: Request, candidates: list[Instance]) -> Instance:
        return self._rng.choice(candidates)

    def explain(self, req: Request, chosen: Instance) -> str | None:
        return LOAD_BALANCE


class RoundRobinPick(Picker):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, req: Request, candidates: list[Instance]) -> Instance:
        ordered = sorted(candidates, key=lambda i: i.name)
        self._next += 1
        return ordered[self._next % len(ordered)]

    def explain(self, req: Request, chosen: Instance) -> str | None:
        return LOAD_BALANCE
