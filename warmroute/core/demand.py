"""The fleet's demand on its genuine capacity, in tokens, and how many instances would meet a target.

An LLM engine's GPU is "busy" whenever one sequence decodes, so busy time says little about how much more it
can take; what bounds time to first token is prefill work. The demand signal therefore measures, per instance:
  * prefill: uncached prompt tokens routed to it per second (plus those waiting for it in the router's queue,
    drained over a horizon) against the prefill rate it has shown (`PrefillRate`, learnt from time to first
    token);
  * decode: requests in flight (and waiting for it in the router) against the concurrency it is allowed;
  * KV: the KV cache its in-flight requests need against its capacity.
The fleet's utilisation of a dimension is its summed demand over its summed capacity; the demand ratio is the
highest of the three (as the Kubernetes HPA takes the highest of several metrics). `desired_instances` is the
HPA formula on it: ceil(current x ratio / target), unchanged within a tolerance band, clamped to [min, max].

Pure values in, values out: the router feeds it from its books (core/fleet.py), the simulator from the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import Field, model_validator

from warmroute.core.fleet import Instance
from warmroute.core.settings_model import SettingsModel
from warmroute.core.stages.prefix_match import kv_pressure

PREFILL, DECODE, KV = "prefill", "decode", "kv"


class DemandSettings(SettingsModel):
    """What an autoscaler acting on the demand signal is told: the target and the bounds (HPA's own terms)."""

    scale_target: float = Field(0.7, gt=0.0, le=1.0)
    """The utilisation the autoscaler aims for: of the fleet's genuine capacity (prefill tokens, concurrency, KV cache)
    for the demand signal; desired instances = ceil(current x utilisation / target)."""
    scale_tolerance: float = Field(0.1, ge=0.0, lt=1.0)
    """No change while utilisation / target is within 1 +- this (the Kubernetes HPA's 10%)."""
    min_instances: int = Field(1, ge=1, le=10_000)
    """Fewest instances the autoscaler asks for."""
    max_instances: int = Field(64, ge=1, le=10_000)
    """Most instances the autoscaler asks for."""
    backlog_horizon_s: float = Field(30.0, gt=0.0, le=3600.0)
    """Seconds over which the prefill of requests waiting in the router's queue counts as demand (backlog / horizon is
    added to the routed rate), so a fleet that has fallen behind asks for more than the rate it managed to take."""

    demand_window_s: float = Field(30.0, gt=0.0, le=3600.0)
    """Seconds over which the tokens routed to each instance are averaged into a rate (an exponential average): long
    enough that one long prompt is not a surge, short enough not to lag a ramp (the autoscaler's own delays come on
    top)."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> DemandSettings:
        if self.min_instances > self.max_instances:
            raise ValueError(f"min_instances ({self.min_instances}) is above max_instances ({self.max_instances})")
        return self


@dataclass(frozen=True)
class InstanceDemand:
    """One instance's demand and capacity, as plain figures."""

    uncached_tokens_per_s: float  # prompt tokens routed to it that it did not have cached, per second
    prefill_tokens_per_s: float  # what it prefills per second (PrefillRate.value)
    # Uncached prompt tokens waiting for it in the router's queue: not routed yet, so not in the rate above.
    # (What an engine has queued was counted in the rate when it was routed: not counted twice.)
    backlog_tokens: float = 0.0
    inflight: float = 0.0  # requests in flight there, plus those waiting for it in the router
    max_inflight: float = 0.0  # the concurrency it is allowed (0: no decode dimension)
    kv_demand_tokens: float = 0.0  # KV cache its in-flight requests need
    kv_capacity_tokens: float = 0.0  # its KV cache (0: no KV dimension)


@dataclass(frozen=True)
class FleetDemand:
    """The fleet's utilisation of each dimension of its capacity (1.0: all of it; above: more than it has)."""

    prefill: float
    decode: float
    kv: float

    @property
    def ratio(self) -> float:
        """The demand ratio (`warmroute_fleet_demand_ratio`): the most-used dimension."""
        return max(self.prefill, self.decode, self.kv)

    def dimensions(self) -> dict[str, float]:
        return {PREFILL: self.prefill, DECODE: self.decode, KV: self.kv}

    @property
    def bottleneck(self) -> str:
        return max(((self.prefill, PREFILL), (self.decode, DECODE), (self.kv, KV)))[1]


def fleet_demand(instances: Sequence[InstanceDemand], backlog_horizon_s: float = 30.0) -> FleetDemand:
    """Summed demand over summed capacity, per dimension, for the instances that take requests."""
    if not instances:
        return FleetDemand(0.0, 0.0, 0.0)
    prefill = sum(i.uncached_tokens_per_s + i.backlog_tokens / backlog_horizon_s for i in instances)
    return FleetDemand(
        _share(prefill, sum(i.prefill_tokens_per_s for i in instances)),
        _share(sum(i.inflight for i in instances), sum(i.max_inflight for i in instances)),
        _share(sum(i.kv_demand_tokens for i in instances), sum(i.kv_capacity_tokens for i in instances)))


def _share(demand: float, capacity: float) -> float:
    return demand / capacity if capacity > 0 else 0.0


def desired_instances(current: int, utilisation: float, target: float, min_instances: int = 1,
                      max_instances: int = 10_000, tolerance: float = 0.1) -> int:
    """The HPA formula: ceil(current x utilisation / target), `current` while within the tolerance band, clamped.

    `current` counts the instances the utilisation was measured over (0 with no instance: min_instances)."""
    low, high = min_instances, max(min_instances, max_instances)
    if current <= 0:
        return low
    ratio = utilisation / target
    wanted = current if abs(ratio - 1.0) <= tolerance else math.ceil(current * ratio - 1e-9)
    return min(high, max(low, wanted))


def desired_for(current: int, utilisation: float, settings: DemandSettings) -> int:
    """desired_instances with a DemandSettings' target, tolerance and bounds."""
    return desired_instances(current, utilisation, settings.scale_target, settings.min_instances,
                             settings.max_instances, settings.scale_tolerance)


class PrefillRate:
    """An instance's prefill rate (tokens/s), learnt from time to first token: a decayed ratio of sums.

    Each observation is the prefill work the instance did between a request's dispatch and its first token
    (its own uncached tokens plus those queued ahead of it there) and that time. The ratio of the decayed sums
    (not the mean of per-request ratios) weighs long prompts by their length, so a short prompt's fixed
    overhead does not drag the rate down as much as its count would. Until observations outweigh it, the
    configured rate counts as `prior_s` seconds' worth of evidence.
    """

    def __init__(self, prior_tokens_per_s: float, window: float = 64.0, prior_s: float = 1.0) -> None:
        self.window = max(1.0, window)  # observations over which old ones fade by 1/e
        self._tokens = prior_tokens_per_s * prior_s
        self._seconds = prior_s
        self.observations = 0

    @property
    def value(self) -> float:
        return self._tokens / self._seconds

    def observe(self, tokens: float, seconds: float) -> None:
        if seconds <= 0.0 or tokens < 0.0 or not math.isfinite(tokens + seconds):
            return
        keep = 1.0 - 1.0 / self.window
        self._tokens = self._tokens * keep + tokens
        self._seconds = self._seconds * keep + seconds
        self.observations += 1


class TokenRate:
    """A rate per second of something counted at given times (tokens routed to an instance), fading with a time
    constant: an exponentially weighted sum over `tau_s`. Times come from the caller (virtual or wall clock);
    `start` is when counting began. Until a full `tau_s` has passed, the sum is divided by what a steady rate
    would have summed over a full `tau_s`: a young meter errs low, never high, because an autoscaler scales up on
    one high reading and down only after a window of low ones (a few long prompts in a meter's first seconds would
    read as a surge)."""

    def __init__(self, tau_s: float = 30.0, start: float = 0.0) -> None:
        self.tau_s = tau_s
        self._start = start
        self._sum = 0.0  # decayed count, as of self._at
        self._at = start

    def add(self, now: float, amount: float) -> None:
        self._decay(now)
        self._sum += amount

    def rate(self, now: float) -> float:
        self._decay(now)
        # The decayed sum of a steady rate r is r x tau_s x (1 - e^(-elapsed / tau_s)): divide by that.
        elapsed = max(now - self._start, self.tau_s)
        return self._sum / (self.tau_s * -math.expm1(-elapsed / self.tau_s))

    def _decay(self, now: float) -> None:
        if now > self._at:
            self._sum *= math.exp(-(now - self._at) / self.tau_s)
            self._at = now


class DemandMeter:
    """Per instance, the routed uncached tokens/s (`TokenRate`) and the learnt prefill rate (`PrefillRate`),
    fed by the router's events, and the fleet's demand from them and the Fleet's books."""

    def __init__(self, tau_s: float = 30.0, prefill_window: float = 64.0) -> None:
        self.tau_s, self.prefill_window = tau_s, prefill_window
        self.started: float | None = None  # the first event's time: every instance's rate counts from it
        self.routed: dict[str, TokenRate] = {}
        self.prefill: dict[str, PrefillRate] = {}

    def dispatched(self, inst: Instance, now: float, uncached_tokens: float) -> None:
        """A request went to `inst` with this many prompt tokens it had not cached."""
        self._meters(inst, now)[0].add(now, uncached_tokens)

    def first_token(self, inst: Instance, now: float, work_tokens: float, seconds: float) -> None:
        """A request's first token came `seconds` after it was sent; `work_tokens`: its uncached tokens plus the
        uncached tokens queued ahead of it there when it was sent (what the instance prefilled meanwhile)."""
        self._meters(inst, now)[1].observe(work_tokens, seconds)

    def forget(self, name: str) -> None:
        self.routed.pop(name, None)
        self.prefill.pop(name, None)

    def instance_demand(self, inst: Instance, now: float, max_inflight: float, waiting: float = 0.0,
                        waiting_tokens: float = 0.0, capacity_scale: float = 1.0) -> InstanceDemand:
        """One instance's figures from its books; `waiting`, `waiting_tokens`: requests (and their uncached
        tokens) waiting for it in the router's queue; `capacity_scale`: engine feedback's factor (Fleet.cache_scale),
        so KV demand is what routing compares with its limits (kv_pressure)."""
        routed, prefill = self._meters(inst, now)
        capacity = inst.kv_capacity_tokens * capacity_scale
        return InstanceDemand(
            uncached_tokens_per_s=routed.rate(now), prefill_tokens_per_s=prefill.value,
            backlog_tokens=waiting_tokens, inflight=inst.inflight + waiting,
            max_inflight=max_inflight, kv_demand_tokens=kv_pressure(inst, capacity_scale) * capacity,
            kv_capacity_tokens=capacity)

    def _meters(self, inst: Instance, now: float) -> tuple[TokenRate, PrefillRate]:
        if inst.name not in self.routed:
            # From the meter's start, not the instance's: a new instance's first cold prompts over its first
            # seconds would read as a surge, though they are traffic the others no longer take.
            self.started = now if self.started is None else self.started
            self.routed[inst.name] = TokenRate(self.tau_s, start=self.started)
            self.prefill[inst.name] = PrefillRate(inst.prefill_tokens_per_s, self.prefill_window)
        return self.routed[inst.name], self.prefill[inst.name]
