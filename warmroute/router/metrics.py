"""Prometheus metrics of one router process, in a private registry (tests can run several routers at once).

With `workers` > 1 the parent makes a directory for prometheus_client's multiprocess mode before forking
(`share_between_workers`); each worker's values then live in memory-mapped files there, and whichever worker
answers a scrape reports the sum over all of them (gauges: per `multiprocess_mode` below), so counters never
seem to go back when successive scrapes reach different workers.

Labelled children are created once per instance when it joins (start-up or discovery): `.labels()` costs a
dictionary build and a lock per call, too much for the per-request path. The engine instance's label is
`backend`, not `instance`, which Prometheus reserves for the scrape target (it would become exported_instance).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess, values
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from warmroute.core.demand import FleetDemand
from warmroute.core.feedback import VERDICTS
from warmroute.core.fleet import Fleet
from warmroute.core.strategies import REASONS

if TYPE_CHECKING:
    from warmroute.router.members import Member

NO_INSTANCE = "none"  # backend label of requests answered before any instance was chosen (400, 413, 503)

_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
MAX_TENANT_LABELS = 64  # tenants labelled at once besides the declared ones; the rest are `other`
TENANT_IDLE_S = 300.0  # a tenant's queue series are removed this long after its last request left the queue
OTHER = "other"  # the label of tenants past MAX_TENANT_LABELS and of a priority that is no class
_OUTCOMES = ("admitted", "shed")
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Predicted minus reported cached share of a prompt: negative when the engine held more than the router thought.
_ERROR_BUCKETS = (-1.0, -0.5, -0.25, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)


class Metrics:
    def __init__(self, strategy: str, instances: list[str], priority_labels: Mapping[int, str] | None = None,
                 declared_tenants: Iterable[str] = ()) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("warmroute_requests", "Requests answered, by instance and status code",
                                ["backend", "status"], registry=r)
        self.inflight = Gauge("warmroute_inflight", "Requests in flight per instance", ["backend"], registry=r,
                              multiprocess_mode="livesum")
        self.engine_capacity = Gauge(
            "warmroute_engine_capacity",
            "Requests each instance's engine runs at once as the router holds it to (engine_capacity, or learned from "
            "its queue and KV usage); absent while unknown: the router never holds requests back for it",
            ["backend"], registry=r, multiprocess_mode="max")
        self.inflight_prompt_tokens = Gauge(
            "warmroute_inflight_prompt_tokens",
            "Prompt tokens of the requests in flight per instance: the KV cache they need (a cached prefix they "
            "share with other requests not counted). Above the instance's KV capacity, the engine evicts cached "
            "prefixes of queued requests before their turn",
            ["backend"], registry=r, multiprocess_mode="livesum")
        self.decisions = Counter("warmroute_decisions", "Routing decisions by strategy and reason",
                                 ["strategy", "reason"], registry=r)
        self.matched_ratio = Histogram("warmroute_matched_prefix_ratio",
                                       "Share of the prompt predicted cached on the chosen instance",
                                       buckets=_RATIO_BUCKETS, registry=r)
        self.ttfb = Histogram("warmroute_time_to_first_byte_seconds",
                              "Seconds from forwarding a request to the upstream's first body byte",
                              ["backend"], buckets=_TTFB_BUCKETS, registry=r)
        self.decision_seconds = Histogram("warmroute_decision_seconds",
                                          "Seconds spent parsing the request and choosing an instance",
                                          buckets=_DECISION_BUCKETS, registry=r)
        # Each worker holds the whole (shared) index: report the scraping worker's latest reading.
        self.index_entries = Gauge("warmroute_index_entries", "Blocks held in the prefix index", registry=r,
                                   multiprocess_mode="livemostrecent")
        self.index_bytes = Gauge("warmroute_index_bytes",
                                 "Memory of the prefix index (allocated by the C store; the Python one's estimate)",
                                 registry=r,
                                 multiprocess_mode="livemostrecent")
        self.healthy = Gauge("warmroute_instance_healthy", "1 while the instance receives traffic",
                             ["backend"], registry=r, multiprocess_mode="livemin")  # every worker's checks agree
        self.upstream_errors = Counter("warmroute_upstream_errors",
                                       "Failed upstream attempts by instance and kind "
                                       "(connect, timeout, disconnect, status_5xx, status_429)",
                                       ["backend", "kind"], registry=r)
        self.retries = Counter("warmroute_retries", "Requests sent again to another instance after this one "
                               "failed before any byte reached the client, by failed instance and kind "
                               "(connect, upstream_timeout, upstream_error)", ["backend", "kind"], registry=r)
        # What the engines say they had cached, next to what the router predicted for the same responses.
        self.engine_prompt_tokens = Counter("warmroute_engine_prompt_tokens",
                                            "Prompt tokens (engine's count) of responses that reported cached "
                                            "tokens", ["backend"], registry=r)
        self.engine_cached_tokens = Counter("warmroute_engine_cached_tokens",
                                            "Prompt tokens the engine reported cached (usage.prompt_tokens_details"
                                            ".cached_tokens or timings.cache_n)", ["backend"], registry=r)
        self.predicted_cached_tokens = Counter("warmroute_predicted_cached_tokens",
                                               "Prompt tokens the router predicted cached for the same responses, "
                                               "scaled to the engine's count", ["backend"], registry=r)
        self.prediction_error = Histogram("warmroute_prediction_error_ratio",
                                          "Per response: the share of the prompt the router predicted cached on "
                                          "the chosen instance minus the share the engine reported cached, by "
                                          "how the prediction was made (approximate: the router's cache model; "
                                          "precise: the engine's KV-cache events)",
                                          ["mode"], buckets=_ERROR_BUCKETS, registry=r)
        self.feedback = Counter("warmroute_index_feedback",
                                "Engine reports by verdict on the index's prediction (confirmed, overpredicted, "
                                "underpredicted)", ["backend", "verdict"], registry=r)
        self.capacity_scale = Gauge("warmroute_index_capacity_scale",
                                    "Factor on the configured KV capacities, learnt from engine reports",
                                    registry=r, multiprocess_mode="livemostrecent")
        self.untokenized_requests = Counter("warmroute_precise_untokenized",
                                            "Requests precise mode could not render or tokenize as the engine "
                                            "would, by cause (no_chat_template, template_error, template_refused, "
                                            "messages, prompt, tokenizer_error): routed on the approximate model",
                                            ["cause"], registry=r)
        self.engine_scrape_errors = Counter("warmroute_engine_scrape_errors",
                                            "Failed or incomplete scrapes of an engine's /metrics by kind "
                                            "(fetch, status, malformed, missing)", ["backend", "kind"],
                                            registry=r)

        # Admission control (core/admission/): the router's queue.
        self.queue_waiting = Gauge("warmroute_queue_waiting",
                                   "Requests waiting in the router for room, by priority and tenant",
                                   ["priority", "tenant"], registry=r, multiprocess_mode="livesum")
        self.queue_bytes = Gauge("warmroute_queue_bytes", "Bytes of request bodies waiting in the router",
                                 registry=r, multiprocess_mode="livesum")
        self.queue_wait = Histogram("warmroute_queue_wait_seconds",
                                    "Seconds a request waited in the router, by priority, tenant and outcome: "
                                    "admitted (sent to an instance) or shed (refused)",
                                    ["priority", "tenant", "outcome"], buckets=_WAIT_BUCKETS, registry=r)
        self.admissions = Counter("warmroute_admissions",
                                  "Requests admitted, by how: immediate, or after waiting in the router because "
                                  "their instance's engine was full (engine_full: its engine_capacity in flight), kv (over hold_kv_limit) or "
                                  "share (its tenant at its tenant_queue_share there) or prefill (its instance at its "
                                  "prefill_budget)",
                                  ["how"], registry=r)
        self.shared_prefill_waits = Histogram(
            "warmroute_shared_prefill_wait_seconds", "Seconds a request was held in the router while a request sent "
            "before it to the same instance computed the prefix they share (shared_prefill_wait_s), by outcome: "
            "computed (that one's first token or end came) or timeout", ["outcome"], buckets=_WAIT_BUCKETS,
            registry=r)
        self.sheds = Counter("warmroute_sheds", "Requests that left the router's queue unserved, by reason (queue_full, "
                             "preempted, deadline: 429; no_instance: 503; client_closed) and priority", ["reason", "priority"],
                             registry=r)
        # Label sets stay bounded whatever clients send: priorities by class (router/tenancy.py), tenants declared
        # in the settings plus at most MAX_TENANT_LABELS others, whose series go once they have left.
        self._priority_labels = dict(priority_labels or {0: "0"})
        self._declared = frozenset(declared_tenants)
        self._tenants: OrderedDict[str, float] = OrderedDict()  # labelled undeclared tenant -> last seen
        self._queued: dict[str, list] = {}  # tenant with requests waiting -> [its label, how many]
        self._evicts = values.ValueClass is values.MutexValue  # multiprocess files keep removed series: no eviction
        self._rendering: asyncio.Future | None = None
        # What autoscalers act on (router/autoscaling.py), refreshed at each scrape. Each worker of several sees
        # its own requests against the whole fleet's capacity, so the workers' ratios add up (livesum).
        self.demand_ratio = Gauge("warmroute_fleet_demand_ratio",
                                  "The fleet's utilisation of its genuine capacity for a model: the most used of "
                                  "prefill (uncached prompt tokens routed per second, plus backlog, over the "
                                  "prefill rate learnt from times to first token), concurrency (requests in "
                                  "flight and waiting over concurrency_threshold) and KV cache (in-flight demand "
                                  "over capacity); 1.0 is all of it", ["model"], registry=r,
                                  multiprocess_mode="livesum")
        # Per dimension, so that several replicas' parts add up before the highest is taken: the sum of the
        # replicas' maxima overstates the fleet's when they are bound by different dimensions.
        self.fleet_utilization = Gauge("warmroute_fleet_utilization",
                                       "This router's part of the fleet's utilisation of one dimension of its "
                                       "capacity for a model (prefill, decode: concurrency, kv): the demand of "
                                       "the requests it routed over the whole fleet's capacity. Summed over "
                                       "router replicas it is the fleet's; the highest dimension of that sum is "
                                       "the demand ratio an autoscaler of several replicas acts on",
                                       ["model", "dimension"], registry=r, multiprocess_mode="livesum")
        self.desired_instances = Gauge("warmroute_desired_instances",
                                       "Instances that would bring the model's demand ratio to scale_target: "
                                       "ceil(current x ratio / scale_target), unchanged within scale_tolerance, "
                                       "within min_instances..max_instances (the HPA formula)", ["model"],
                                       registry=r, multiprocess_mode="livemax")
        # Disaggregated serving (core/disaggregation.py): what was split and why, each leg's outcome per pool.
        self.pd_decisions = Counter("warmroute_pd_decisions", "Requests in a disaggregated fleet: split into a "
                                    "prefill and a decode leg, or sent whole to a decode instance, and why (split, "
                                    "short_prompt, cached_at_decode, no_prefill_instance, not_splittable)", ["why"],
                                    registry=r)
        self.pd_legs = Counter("warmroute_pd_legs", "Legs of split requests by pool (prefill, decode) and outcome (ok; "
                               "failed: retried or sent whole elsewhere)", ["pool", "outcome"], registry=r)
        self.pd_transfer_tokens = Counter("warmroute_pd_transfer_tokens", "Prompt tokens of split requests that their "
                                          "decode instance was predicted not to hold: moved from the prefill "
                                          "instance's KV cache", registry=r)

        self._strategy = strategy
        self._desired_of: Callable[[str, float], int | None] | None = None  # set_demand's
        self._decision = {reason: self.decisions.labels(strategy, reason) for reason in REASONS}
        self._inflight: dict = {}
        self._ttfb: dict = {}
        self._healthy: dict = {}
        self._engine: dict = {}
        self._verdicts: dict = {}
        self._answered: dict = {}  # (backend, status) -> its warmroute_requests child
        for name in instances:
            self.add_backend(name)

    # -- membership (discovery) ---------------------------------------------------------------------------
    def add_backend(self, name: str, healthy: bool = True) -> None:
        if name not in self._inflight:
            self._inflight[name] = (self.inflight.labels(name), self.inflight_prompt_tokens.labels(name))
            self._ttfb[name] = self.ttfb.labels(name)
            self._healthy[name] = self.healthy.labels(name)
            self._engine[name] = (self.engine_prompt_tokens.labels(name), self.engine_cached_tokens.labels(name),
                                  self.predicted_cached_tokens.labels(name))
            self._verdicts.update({(name, v): self.feedback.labels(name, v) for v in VERDICTS})
        self._healthy[name].set(1 if healthy else 0)

    # -- membership (members.py; built with the configured backends, so it is subscribed without replay) -----
    def added(self, member: Member) -> None:
        self.add_backend(member.name, healthy=False)  # until its first health check passes

    def changed(self, member: Member) -> None:
        pass

    def removed(self, name: str) -> None:
        self.remove_backend(name)

    def remove_backend(self, name: str) -> None:
        """The instance left the fleet: drop its gauges (counters stay, so rates over them remain right)."""
        if self._inflight.pop(name, None) is not None:
            self.inflight.remove(name)
            self.inflight_prompt_tokens.remove(name)
        if self._healthy.pop(name, None) is not None:
            self.healthy.remove(name)
        self.set_engine_capacity(name, None)

    def set_engine_capacity(self, name: str, limit: int | None) -> None:
        """The requests the router holds `name`'s engine to (None: unknown, the series is dropped)."""
        if limit is not None:
            self.engine_capacity.labels(name).set(limit)
        else:
            try:
                self.engine_capacity.remove(name)
            except KeyError:
                pass

    # -- per-request hooks (cheap) ------------------------------------------------------------------------
    def decided(self, reason: str, matched_ratio: float, seconds: float) -> None:
        counter = self._decision.get(reason)
        if counter is None:  # a reason the core added after this process started counting
            counter = self._decision[reason] = self.decisions.labels(self._strategy, reason)
        counter.inc()
        self.matched_ratio.observe(matched_ratio)
        self.decision_seconds.observe(seconds)

    def tenant_label(self, tenant: str) -> str:
        """A tenant's label: its name if declared or among the MAX_TENANT_LABELS labelled now (a new one takes the
        place of the least recently seen with nothing waiting, whose series are removed), else `other`."""
        if tenant in self._declared:
            return tenant
        if tenant in self._tenants:
            self._tenants[tenant] = time.monotonic()
            self._tenants.move_to_end(tenant)
            return tenant
        if len(self._tenants) >= MAX_TENANT_LABELS:
            gone = next((t for t in self._tenants if t not in self._queued), None) if self._evicts else None
            if gone is None:
                return OTHER
            self._drop_tenant(gone)
        self._tenants[tenant] = time.monotonic()
        return tenant

    def _drop_tenant(self, tenant: str) -> None:
        """Its queue series out of the registry (a tenant that left: the label set stays bounded)."""
        del self._tenants[tenant]
        for priority in [*self._priority_labels.values(), OTHER]:
            self.queue_waiting.remove(priority, tenant)
            for outcome in _OUTCOMES:
                self.queue_wait.remove(priority, tenant, outcome)

    def expire_tenants(self, now: float | None = None) -> None:
        """Removes the series of tenants idle for TENANT_IDLE_S with nothing waiting (at each scrape)."""
        if not self._evicts:
            return
        now = time.monotonic() if now is None else now
        for tenant, seen in list(self._tenants.items()):
            if now - seen < TENANT_IDLE_S:
                break  # least recently seen first: the rest are newer
            if tenant not in self._queued:
                self._drop_tenant(tenant)

    def priority_label(self, priority: int) -> str:
        return self._priority_labels.get(priority, OTHER)

    def admitted(self, how: str) -> None:
        self.admissions.labels(how).inc()

    def queue_changed(self, priority: int, tenant: str, delta: int, queue_bytes: int) -> None:
        queued = self._queued.get(tenant)
        if queued is None:  # counted under the label it got on arrival until its last waiting request leaves
            queued = self._queued[tenant] = [self.tenant_label(tenant), 0]
        queued[1] += delta
        self.queue_waiting.labels(self.priority_label(priority), queued[0]).inc(delta)
        if queued[1] <= 0:
            del self._queued[tenant]
        self.queue_bytes.set(queue_bytes)

    def left_queue(self, priority: int, tenant: str, seconds: float, shed: str | None) -> None:
        queued = self._queued.get(tenant)
        label = queued[0] if queued is not None else self.tenant_label(tenant)
        self.queue_wait.labels(self.priority_label(priority), label, "shed" if shed else "admitted").observe(seconds)
        if shed:
            self.sheds.labels(shed, self.priority_label(priority)).inc()

    def shared_prefill_wait(self, outcome: str, seconds: float) -> None:
        self.shared_prefill_waits.labels(outcome).observe(seconds)

    def untokenized(self, cause: str) -> None:
        self.untokenized_requests.labels(cause).inc()

    def set_inflight(self, name: str, requests: int, prompt_tokens: int = 0) -> None:
        gauges = self._inflight.get(name)
        if gauges is not None:  # None: removed from the fleet while this request was in flight
            gauges[0].set(requests)
            gauges[1].set(prompt_tokens)

    def first_byte(self, name: str, seconds: float) -> None:
        hist = self._ttfb.get(name)
        if hist is not None:
            hist.observe(seconds)

    def answered(self, instance: str, status: int) -> None:
        counter = self._answered.get((instance, status))
        if counter is None:  # first answer with this status from this instance
            counter = self._answered[instance, status] = self.requests.labels(instance, str(status))
        counter.inc()

    def upstream_error(self, instance: str, kind: str) -> None:
        self.upstream_errors.labels(instance, kind).inc()

    def pd_decided(self, why: str) -> None:
        self.pd_decisions.labels(why).inc()

    def pd_leg(self, pool: str, outcome: str, transfer_tokens: int = 0) -> None:
        self.pd_legs.labels(pool, outcome).inc()
        if transfer_tokens:
            self.pd_transfer_tokens.inc(transfer_tokens)

    def retried(self, instance: str, kind: str) -> None:
        self.retries.labels(instance, kind).inc()

    def engine_usage(self, name: str, prompt_tokens: int, cached_tokens: int, predicted_tokens: float,
                     verdict: str | None, mode: str = "approximate") -> None:
        if name not in self._engine:
            return
        prompt, cached, predicted = self._engine[name]
        prompt.inc(prompt_tokens)
        cached.inc(cached_tokens)
        predicted.inc(predicted_tokens)
        if prompt_tokens > 0:
            self.prediction_error.labels(mode).observe((predicted_tokens - cached_tokens) / prompt_tokens)
        if verdict is not None:
            self._verdicts[name, verdict].inc()

    def scrape_error(self, name: str, kind: str) -> None:
        self.engine_scrape_errors.labels(name, kind).inc()

    def set_healthy(self, name: str, healthy: bool) -> None:
        gauge = self._healthy.get(name)
        if gauge is not None:
            gauge.set(1 if healthy else 0)

    def set_demand(self, by_model: dict[str, tuple[FleetDemand, int]],
                   desired_of: Callable[[str, float], int | None] | None = None) -> None:
        """The demand ratio, its dimensions and desired instances per model (models no longer served drop out).
        `desired_of(model, ratio)`: the desired instances for a ratio measured over all the workers (None: the
        model is not served here), for the merged scrape of a worker of several."""
        self._desired_of = desired_of
        self.demand_ratio.clear()
        self.fleet_utilization.clear()
        self.desired_instances.clear()
        for model, (demand, desired) in by_model.items():
            self.demand_ratio.labels(model).set(demand.ratio)
            for dimension, value in demand.dimensions().items():
                self.fleet_utilization.labels(model, dimension).set(value)
            self.desired_instances.labels(model).set(desired)

    # -- scrape -------------------------------------------------------------------------------------------
    def render(self, fleet: Fleet) -> tuple[bytes, str]:
        """The exposition text, with the index gauges refreshed (they are cheap to read, so only at scrape)."""
        self.refresh(fleet)
        return self.exposition_text()

    def refresh(self, fleet: Fleet) -> None:
        """The gauges read at scrape time, on the event loop (the index is not to be read from another thread)."""
        self.index_entries.set(fleet.index.entries())
        self.index_bytes.set(fleet.index.estimated_bytes())
        self.capacity_scale.set(fleet.cache_scale.value)
        self.expire_tenants()

    async def exposition(self, fleet: Fleet) -> tuple[bytes, str]:
        """render, with the text made in a thread (prometheus_client's collection takes each metric's lock), and
        one rendering shared by the scrapes that arrive while it runs: the event loop keeps serving meanwhile."""
        self.refresh(fleet)
        if self._rendering is None:
            self._rendering = asyncio.ensure_future(asyncio.to_thread(self.exposition_text))
            self._rendering.add_done_callback(self._rendered)
        return await asyncio.shield(self._rendering)

    def _rendered(self, _: asyncio.Future) -> None:
        self._rendering = None

    def exposition_text(self) -> tuple[bytes, str]:
        if _SHARED_DIR in os.environ and values.ValueClass is not values.MutexValue:  # a worker of several
            merged = CollectorRegistry()
            merged.register(WorkersMerged(self._desired_of))
            return generate_latest(merged), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_SHARED_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's name for it


class WorkersMerged:
    """The workers' metrics merged (prometheus_client's multiprocess files), but for the demand ratio and the
    desired instances: each worker's own count only the requests it routed, and the sum of the workers' ratios
    overstates the fleet's when they are bound by different dimensions, so both are worked out again from the
    demand dimensions summed over the workers (livesum), as an autoscaler summing router replicas would."""

    def __init__(self, desired_of: Callable[[str, float], int | None] | None) -> None:
        self.desired_of = desired_of

    def collect(self) -> Iterator[Metric]:
        families = list(multiprocess.MultiProcessCollector(None).collect())
        ratios: dict[str, float] = {}  # model -> the highest of its summed dimensions
        for family in families:
            if family.name == "warmroute_fleet_utilization":
                for sample in family.samples:
                    model = sample.labels["model"]
                    ratios[model] = max(ratios.get(model, 0.0), sample.value)
        for family in families:
            if family.name == "warmroute_fleet_demand_ratio":
                family = GaugeMetricFamily(family.name, family.documentation, labels=["model"])
                for model, ratio in sorted(ratios.items()):
                    family.add_metric([model], ratio)
            elif family.name == "warmroute_desired_instances" and self.desired_of is not None:
                desired = GaugeMetricFamily(family.name, family.documentation, labels=["model"])
                for model, ratio in sorted(ratios.items()):
                    if (n := self.desired_of(model, ratio)) is not None:
                        desired.add_metric([model], n)
                family = desired
            yield family


def share_between_workers(directory: str) -> None:
    """In the parent, before forking the workers: their metrics go to `directory` (see the module's doc)."""
    os.environ[_SHARED_DIR] = directory


def in_worker() -> None:
    """In a forked worker, before its metrics exist: keep their values in the shared directory."""
    if _SHARED_DIR in os.environ:
        values.ValueClass = values.MultiProcessValue()


def worker_gone(pid: int) -> None:
    """In the parent, when a worker has exited: drop its live gauges."""
    if _SHARED_DIR in os.environ:
        multiprocess.mark_process_dead(pid)
