"""A pool of long shared texts (system prompts, documents) drawn with Zipf popularity."""

from __future__ import annotations

import random

from warmroute.workloads.text import chars_for, filler, rng_for
from warmroute.workloads.zipf import Zipf


class TextPool:
    def __init__(self, seed: int, label: str, size: int, tokens: int, zipf_s: float) -> None:
        self.seed, self.label, self.size, self.tokens = seed, label, size, tokens
        self._zipf = Zipf(size, zipf_s)
        self._texts: dict[int, str] = {}

    def text(self, i: int) -> str:
        """Item i: a fixed header naming it, then deterministic filler, `tokens` tokens in all."""
        got = self._texts.get(i)
        if got is None:
            head = f"[{self.label} {i}] "
            body = filler(rng_for(self.seed, self.label, i), max(0, chars_for(self.tokens) - len(head)))
            got = self._texts[i] = head + body
        return got

    def draw(self, rng: random.Random) -> int:
        return self._zipf.sample(rng)

    def draw_distinct(self, rng: random.Random, k: int) -> list[int]:
        """k different items, each drawn by popularity (retrieval never returns a document twice)."""
        out: list[int] = []
        while len(out) < min(k, self.size):
            i = self._zipf.sample(rng)
            if i not in out:
                out.append(i)
        return out

    @property
    def total_tokens(self) -> int:
        return self.size * self.tokens
