"""Slow start: a new instance's share of traffic ramps up over a window instead of arriving all at once.

Envoy's slow_start_config: weight = max(min_weight, time_factor ^ (1 / aggression)), time_factor = elapsed /
window, and the full weight (1.0) from the end of the window on. aggression 1 ramps linearly; above 1 the
weight rises fast at first, below 1 slowly. A new instance's cache is empty, so every request it takes is
a cold prefill: taking its full share at once makes it the fleet's slowest for a while.

Pure: the caller says how old the instance is; a router stage multiplies the instance's share (or divides its
cost) by the weight. `slow_start_weight(age, window)` is 1.0 for any instance older than the window, and for
every instance when the window is 0 (slow start off).
"""

from __future__ import annotations


def slow_start_weight(age_s: float, window_s: float, aggression: float = 1.0, min_weight: float = 0.1) -> float:
    """The share of its full weight an instance `age_s` seconds old gets, in [min_weight, 1]."""
    if window_s <= 0.0 or age_s >= window_s:
        return 1.0
    time_factor = max(age_s, 0.0) / window_s
    return max(min_weight, time_factor ** (1.0 / max(aggression, 1e-6)))
