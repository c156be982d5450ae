"""A workload's arrival rate changing over time: a piecewise-constant multiplier of its base rate (or speed).

The shape warps time rather than drawing arrivals itself: a driver draws arrival times at the base rate (a
Poisson process, or a trace's own timestamps) on a "base clock", and `time_of` maps each to the wall (or
virtual) time at which the same cumulative number of arrivals is due when the rate is multiplied by m(t).
A Poisson process so warped is a Poisson process of rate base x m(t); a trace so warped is replayed at m(t)
times its speed. One mechanism for both, and the requests themselves are unchanged.

`ramp_and_burst` is the autoscaling benchmark's shape: quiet, a ramp up, a burst, the ramp back down, quiet.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from warmroute.errors import UsageError


@dataclass(frozen=True)
class RateShape:
    """Multiplier `steps[i][1]` from time `steps[i][0]` (seconds, the first at 0) until the next step; a last
    step of multiplier 0 ends the arrivals there (`end_s`)."""

    steps: tuple[tuple[float, float], ...]
    name: str = ""

    def __post_init__(self) -> None:
        times = [t for t, _ in self.steps]
        if not self.steps or times[0] != 0.0 or times != sorted(set(times)):
            raise UsageError("a rate shape's steps start at 0 and their times increase")
        if any(not m > 0.0 for _, m in self.steps[:-1]) or not self.steps[-1][1] >= 0.0 or len(self.steps) < 2 \
                and self.steps[0][1] == 0.0:
            raise UsageError("a rate shape's multipliers must be > 0 (but for a last one of 0: the end)")
        starts = [0.0]  # base-clock time at the start of each step: the integral of the multiplier so far
        for (t0, m), (t1, _) in zip(self.steps, self.steps[1:]):
            starts.append(starts[-1] + m * (t1 - t0))
        object.__setattr__(self, "_base_starts", tuple(starts))

    @property
    def end_s(self) -> float | None:
        """When arrivals stop (None: never)."""
        return self.steps[-1][0] if self.steps[-1][1] == 0.0 else None

    def multiplier(self, t: float) -> float:
        return self.steps[max(0, bisect.bisect_right([s for s, _ in self.steps], t) - 1)][1]

    def time_of(self, base_t: float) -> float:
        """The time by which base_t of base-clock time has passed at the shaped rate (inf: after the end)."""
        starts: tuple[float, ...] = self._base_starts  # type: ignore[attr-defined]
        i = max(0, bisect.bisect_right(starts, base_t) - 1)
        t0, m = self.steps[i]
        return t0 + (base_t - starts[i]) / m if m > 0.0 else math.inf

    def describe(self) -> str:
        return self.name or ",".join(f"{t:g}:{m:g}" for t, m in self.steps)


def ramp_and_burst(quiet: float = 0.25, peak: float = 1.0, burst: float = 2.0, step_s: float = 30.0,
                   quiet_s: float = 180.0, ramp_s: float = 360.0, hold_s: float = 180.0,
                   burst_s: float = 120.0) -> RateShape:
    """quiet -> linear ramp (in steps of step_s) to peak -> peak -> a burst -> peak -> ramp down -> quiet, end."""
    steps: list[tuple[float, float]] = [(0.0, quiet)]
    t = quiet_s
    n = max(1, round(ramp_s / step_s))
    for k in range(1, n + 1):  # up
        steps.append((t, quiet + (peak - quiet) * k / n))
        t += ramp_s / n
    steps += [(t, peak), (t + hold_s, burst), (t + hold_s + burst_s, peak)]
    t += 2 * hold_s + burst_s
    for k in range(1, n + 1):  # down
        steps.append((t, peak - (peak - quiet) * k / n))
        t += ramp_s / n
    steps.append((t + quiet_s - ramp_s / n, 0.0))
    return RateShape(tuple(_merged(steps)), name="ramp-burst")


def _merged(steps: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for t, m in steps:
        if out and out[-1][1] == m:
            continue
        out.append((t, m))
    return out


NAMED = {"ramp-burst": ramp_and_burst}


def parse_rate_shape(text: str) -> RateShape:
    """A named shape (ramp-burst) or steps `T:M,T:M,...` (seconds:multiplier, the first at 0)."""
    if text in NAMED:
        return NAMED[text]()
    try:
        steps = tuple((float(t), float(m)) for t, m in (part.split(":") for part in text.split(",")))
    except ValueError:
        raise UsageError(f"--rate-shape expects {' or '.join(NAMED)} or T:M,T:M,... (seconds:multiplier), "
                         f"got {text!r}") from None
    return RateShape(steps)
