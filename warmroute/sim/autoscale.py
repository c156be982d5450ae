"""The simulator's autoscaler: a Kubernetes HPA in virtual time, on the demand signal or on busy time.

Every `interval_s` the autoscaler reads one signal over the ready instances:
  * demand: the fleet's utilisation of its genuine capacity (core/demand.py: prefill tokens, concurrency, KV),
    what `warmroute serve` exports as warmroute_fleet_demand_ratio;
  * utilization: the fraction of the last interval the instances' engines were busy (a step running), the
    signal GPU utilisation gives an autoscaler: an engine decoding one sequence counts as fully busy.
It applies the HPA formula (desired = ceil(ready x signal / target), a tolerance band, min/max), scales up at
once (by at most HPA's default step: double, or 4 more, per reading) and down only to the highest desired
count of the last `scale_down_window_s` (HPA's stabilisation window). A decision takes effect `reaction_delay_s` later (metrics pipeline, controller); an instance added
then takes `startup_s` to become ready (scheduling, pulling, loading weights) and costs from the moment it is
created. Scale-in drains the instance the `scale_in` policy picks.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

from pydantic import Field

from warmroute.core.demand import DemandSettings, desired_for

DEMAND, UTILIZATION = "demand", "utilization"
SIGNALS = (DEMAND, UTILIZATION)
CACHE_AWARE, ARBITRARY, NEWEST = "cache_aware", "arbitrary", "newest"
SCALE_IN_POLICIES = (CACHE_AWARE, ARBITRARY, NEWEST)
SCALE_UP_PODS = 4


class AutoscaleSettings(DemandSettings):
    """The simulator's autoscaler (off unless `autoscale` names a signal) and how scale-in picks its victim."""

    autoscale: Literal["demand", "utilization"] | None = None
    """Run an autoscaler on this signal: demand (the fleet's utilisation of its prefill, concurrency and KV capacity) or
    utilization (the share of time engines are busy, as GPU utilisation reports it). Unset: the fleet is fixed (but for
    --scale-at)."""
    interval_s: float = Field(15.0, gt=0.0, le=3600.0)
    """Seconds between two readings of the signal (the HPA's sync period)."""
    reaction_delay_s: float = Field(15.0, ge=0.0, le=3600.0)
    """Seconds from a reading to the change it asks for (metrics pipeline and controller)."""
    startup_s: float = Field(60.0, ge=0.0, le=3600.0)
    """Seconds from creating an instance to its first request (scheduling, image, weights); it costs instance-seconds
    from creation."""
    scale_down_window_s: float = Field(300.0, ge=0.0, le=3600.0)
    """Scale down only to the highest count asked for over this many seconds (the HPA's stabilisation window; 300 s is
    Kubernetes' default)."""
    scale_in: Literal["cache_aware", "arbitrary", "newest"] = "newest"
    """Which instance a scale-in drains: cache_aware (the one whose cached prefixes, weighted by demand, no other holds
    the least of: core/cache_value.py), arbitrary (a random one) or newest (Kubernetes' order without deletion costs,
    and what --scale-at always did)."""
    slo_ttft_s: float = Field(2.0, gt=0.0, le=3600.0)
    """The TTFT p99 SLO whose attainment the report counts, in seconds."""
    slo_window_s: float = Field(60.0, gt=0.0, le=3600.0)
    """Windows (by arrival) over which the report checks the SLO."""
    slo_tokens_per_s: float = Field(0.0, ge=0.0, le=1e9)
    """Each request's TTFT objective grows by its prompt tokens / this (0: one flat objective), for workloads whose
    longest prompts take longer than the SLO to prefill on any fleet."""


class Autoscaler:
    """The HPA's decision from one reading: how many instances the fleet should have."""

    def __init__(self, settings: AutoscaleSettings) -> None:
        self.s = settings
        self._recent: deque[tuple[float, int]] = deque()  # (time, desired) over the stabilisation window

    def decide(self, now: float, ready: int, provisioned: int, signal: float) -> int:
        """The count to converge to, from `signal` read over `ready` instances, `provisioned` (ready + starting)
        being what the fleet has now."""
        desired = desired_for(ready, signal, self.s) if ready else max(self.s.min_instances, provisioned)
        self._recent.append((now, desired))
        while self._recent and self._recent[0][0] < now - self.s.scale_down_window_s:
            self._recent.popleft()
        if desired >= provisioned:  # HPA's default scale-up policy: 100% or 4 pods per period, the larger
            return min(desired, max(2 * provisioned, provisioned + SCALE_UP_PODS))
        return min(provisioned, max(d for _, d in self._recent))
