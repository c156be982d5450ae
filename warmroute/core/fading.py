"""Counts that fade: each count loses weight exponentially, by 1/e over a window of later counts.

Rather than multiplying every stored count down on every new one, each new count is worth (1 + 1/window) times
the one before: one addition per count, whatever the number of counts kept. Stored counts are in units of
`FadingUnit.value` (the worth of a count made now) and are divided down together, rarely, before the weights
could overflow. Used for the requests each instance was sent lately (Fleet) and each prefix's share of them
(Popularity).
"""

from __future__ import annotations

RESCALE_AT = 1e100


class FadingUnit:
    def __init__(self) -> None:
        self.value = 1.0  # what a count made now adds

    def advance(self, window: float) -> float | None:
        """One count was made. Returns the factor to divide every stored count by when they are rescaled now
        (None almost always)."""
        self.value *= 1.0 + 1.0 / (window if window > 1.0 else 1.0)  # max(1.0, window) without a call
        if self.value < RESCALE_AT:
            return None
        factor, self.value = self.value, 1.0
        return factor
