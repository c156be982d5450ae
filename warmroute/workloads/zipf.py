"""Zipf popularity over a finite pool: rank k (0-based) is drawn with weight 1 / (k + 1) ** s."""

from __future__ import annotations

import random
from bisect import bisect_right
from itertools import accumulate


class Zipf:
    def __init__(self, n: int, s: float) -> None:
        if n < 1:
            raise ValueError("a Zipf pool needs at least one item")
        self.n = n
        self._cum = list(accumulate(1.0 / (k + 1) ** s for k in range(n)))

    def sample(self, rng: random.Random) -> int:
        return min(self.n - 1, bisect_right(self._cum, rng.random() * self._cum[-1]))

    def share(self, k: int) -> float:
        """Probability of rank k."""
        return (self._cum[k] - (self._cum[k - 1] if k else 0.0)) / self._cum[-1]
