"""What the router tells autoscalers: the fleet's demand on its genuine capacity, and what each instance's cache is
worth (docs/autoscaling.md).

The figures are the core's (core/demand.py, core/cache_value.py); this module only feeds them from the router's
events, with the router's clock, and reads them per model:

  * `warmroute_fleet_demand_ratio{model}`: the fleet's utilisation of its prefill, concurrency and KV capacity
    (the most used), from the uncached tokens routed to each instance, the prefill rate learnt from its times to
    first token, its backlog, its requests in flight and waiting in the router, its KV demand;
  * `warmroute_desired_instances{model}`: the HPA formula on it, ceil(current x ratio / scale_target);
  * per instance, the cached prefill only it holds, weighted by how often it is asked for: the scale-in victim
    (`GET /admin/scale-in`) and the pods' deletion costs (router/kubernetes.py PodDeletionCost).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from warmroute.core.admission import Admission
from warmroute.core.cache_value import CacheValue, deletion_costs, scale_in_victim
from warmroute.core.demand import DemandMeter, DemandSettings, FleetDemand, desired_for, fleet_demand
from warmroute.core.fleet import Fleet, Instance

ALL_MODELS = "*"  # the model label when no instance says what it serves: the whole fleet


@dataclass(frozen=True)
class ModelDemand:
    demand: FleetDemand  # per dimension (warmroute_fleet_utilization); its ratio is warmroute_fleet_demand_ratio
    desired: int  # warmroute_desired_instances
    current: int  # the routable instances it was measured over

    @property
    def ratio(self) -> float:
        return self.demand.ratio

    @property
    def bottleneck(self) -> str:  # prefill, decode or kv
        return self.demand.bottleneck


class FleetSignals:
    """Fed at dispatch and first token (router/routing.py _Books); read at scrape and by the scale-in surfaces."""

    def __init__(self, fleet: Fleet, admission: Admission, demand: DemandSettings, max_inflight: int) -> None:
        self.fleet, self.admission, self.demand = fleet, admission, demand
        self.max_inflight = max_inflight  # per instance: the concurrency threshold
        self.meter = DemandMeter(demand.demand_window_s)
        self.cache = CacheValue()

    # -- events (per request: cheap) ------------------------------------------------------------------------
    def dispatched(self, inst: Instance, uncached_tokens: int) -> None:
        self.meter.dispatched(inst, time.monotonic(), uncached_tokens)

    def requested(self, blocks: Sequence[int]) -> None:
        """The request's chain, once recorded (after it was sent: a cold prompt's chain is hashed only then)."""
        self.cache.requested(blocks)

    def first_token(self, name: str, work_tokens: float, seconds: float) -> None:
        """`work_tokens`: the request's uncached tokens plus those queued ahead of it there when it was sent."""
        inst = self.fleet.instances.get(name)
        if inst is not None:
            self.meter.first_token(inst, time.monotonic(), work_tokens, seconds)

    # -- readings -----------------------------------------------------------------------------------------
    def by_model(self) -> dict[str, ModelDemand]:
        """The demand ratio and desired instances per model served (ALL_MODELS when none is known)."""
        fleet, now = self.fleet, time.monotonic()
        for gone in [n for n in self.meter.routed if n not in fleet.instances]:
            self.meter.forget(gone)
        waiting = self.admission.waiting_for()
        up = fleet.routable()
        scale = fleet.cache_scale.value
        figures = {i.name: self.meter.instance_demand(i, now, self.max_inflight, *waiting.get(i.name, (0, 0.0)),
                                                      capacity_scale=scale) for i in up}
        models = sorted({m for i in up if i.models is not None for m in i.models}) or [ALL_MODELS]
        out = {}
        for model in models:
            serving = [i.name for i in (up if model == ALL_MODELS else fleet.routable(model))]
            demand = fleet_demand([figures[n] for n in serving], self.demand.backlog_horizon_s)
            out[model] = ModelDemand(demand, desired_for(len(serving), demand.ratio, self.demand), len(serving))
        return out

    def desired_for(self, current: int, ratio: float) -> int:
        """The HPA formula on a ratio measured elsewhere (the workers' summed dimensions) with this router's target
        and bounds."""
        return desired_for(current, ratio, self.demand)

    def cache_values(self) -> dict[str, float]:
        """Per instance, the prefill tokens per request that would be recomputed if it went."""
        fleet = self.fleet
        return self.cache.values(fleet.index, list(fleet.instances), fleet.block_tokens)

    def deletion_costs(self) -> dict[str, int]:
        """Per instance, its pod's controller.kubernetes.io/pod-deletion-cost (higher: keep)."""
        return deletion_costs(self.cache_values())

    def scale_in(self) -> dict:
        """`GET /admin/scale-in`'s answer: the instance whose cache is worth least, every value, the deletion
        costs they map to."""
        values = self.cache_values()
        candidates = {n: v for n, v in values.items() if not self.fleet.instances[n].draining}
        return {"victim": scale_in_victim(candidates), "values": values, "deletion_costs": deletion_costs(values)}
