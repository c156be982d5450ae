"""A fleet of emulated engines behind the router, simulated in virtual time: no HTTP, no sleeping.

Every piece that decides anything is the production piece: requests come from `warmroute.workloads`, the
routing key from `core.routing_key`, the choice from the strategy objects `warmroute serve` uses (keeping
its books in the same `core.fleet.Fleet`), and each instance is the `engine.model.EngineModel` that
`warmroute engine` runs in real time. The simulator only owns the clock: an event heap of arrivals and
step completions. Consecutive pure-decode steps are fused up to the next event, which is what lets 100,000
requests run in seconds.
"""

from __future__ import annotations

import heapq
import math
import itertools
import random
from functools import partial
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

from warmroute.core.admission import Admission, AdmissionConfig, AdmissionSettings, QueueFull, Waiter, admission_settings, decide_at
from warmroute.core.cache_value import CacheValue, scale_in_victim
from warmroute.core.demand import DemandMeter, fleet_demand
from warmroute.core.disaggregation import DECODE, PREFILL, SPLIT, DisaggregationSettings, Plan, decode_after, plan
from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.lifecycle import Leg, Lifecycle
from warmroute.core.routing_key import BYTES_PER_TOKEN, RoutingKey, key_for_json
from warmroute.core.stages import Handles
from warmroute.core.strategies import (Decision, NoInstanceAvailable, Strategy, StrategyProfile, StrategySettings,
                                       make_strategy, merge_layers, settings_for)
from warmroute.engine.model import EngineConfig, EngineModel
from warmroute.sim.autoscale import ARBITRARY, CACHE_AWARE, DEMAND, AutoscaleSettings, Autoscaler
from warmroute.workloads.base import Workload
from warmroute.workloads.rate_shape import RateShape
from warmroute.workloads.request import Session, WorkloadRequest


@dataclass
class SimSettings:
    instances: int = 8
    profile: str = "8b"
    kv_capacity_tokens: int | None = None  # per instance; None: the profile's
    router_kv_capacity_tokens: int | None = None  # the router's idea of it (misconfiguration); None: the truth
    feedback: bool = True  # correct the router's index from the cached tokens each engine reports
    max_running: int = 64
    # The requests the router is told each engine runs at once (engine_capacity); None: learned from its scrapes.
    engine_capacity: int | None = None
    scrape_interval_s: float = 1.0  # the router's scrapes of each engine's load (engine_metrics_interval)
    max_batched_tokens: int = 8192
    # The router's strategy settings, as `warmroute serve` takes them: the admission queue's (routing.admission,
    # the router's `admission:`, by the same names: StrategySettings(admission={"fair_lend": 2}), or
    # StrategySettings(fair_lend=2); admission=False turns it off) and cache_aware's hold_kv_limit, hold_keep and
    # hold_timeout, which the admission queue applies too.
    routing: StrategySettings = field(default_factory=StrategySettings)
    # Strategies defined in a config file (`strategies:` of `warmroute simulate --config`), by name.
    profiles: dict[str, StrategyProfile] = field(default_factory=dict)
    requests: int = 10_000
    rate: float | None = None  # open loop (Poisson sessions per second); None with no concurrency: the trace's
    concurrency: int | None = None  # closed loop: this many sessions in flight
    speedup: float = 1.0  # trace timestamps are divided by this
    rate_shape: RateShape | None = None  # the arrival rate (or trace speed) multiplied over time
    scale_events: list[tuple[float, int]] = field(default_factory=list)  # (time s, +1 or -1)
    autoscale: AutoscaleSettings = field(default_factory=AutoscaleSettings)  # off unless .autoscale is set
    window_s: float = 10.0  # time-series bucket
    # Disaggregated prefill/decode: the first `prefill_instances` of the fleet prefill, the others decode (0: every
    # instance serves whole requests); the router splits as `warmroute serve` does (pd_threshold_tokens). The KV
    # cache moves at transfer_tokens_per_s, after transfer_latency_s per request.
    prefill_instances: int = 0
    pd: DisaggregationSettings = field(default_factory=DisaggregationSettings)
    transfer_tokens_per_s: float = 100_000.0
    transfer_latency_s: float = 0.002
    seed: int = 0

    def engine_config(self, scale: int = 1) -> EngineConfig:
        """One instance's engine; `scale` > 1 gives the pooled reference: scale× cache and compute."""
        cfg = EngineConfig.from_profile(self.profile, kv_capacity_tokens=self.kv_capacity_tokens,
                                        max_running=self.max_running * scale,
                                        max_batched_tokens=self.max_batched_tokens * scale)
        if scale == 1:
            return cfg
        t = cfg.timing
        timing = replace(t, prefill_ms_per_token=t.prefill_ms_per_token / scale,
                         context_ms_per_token=t.context_ms_per_token / scale,
                         prefill_context_ms=t.prefill_context_ms / scale, decode_growth=t.decode_growth / scale)
        return replace(cfg, timing=timing, kv_capacity_tokens=cfg.kv_capacity_tokens * scale)

    def changed(self, name: str, value: object) -> SimSettings:
        """A copy with one setting changed: the simulator's own, or a strategy setting by its plain name."""
        if name in {f.name for f in fields(self)}:
            return replace(self, **{name: value})
        return replace(self, routing=StrategySettings(**merge_layers(self.routing.model_dump(), {name: value})))

    @property
    def admission(self) -> AdmissionConfig:
        """The admission queue's settings (routing.admission)."""
        return self.routing.admission

    def admission_settings(self, strategy: str = "") -> AdmissionSettings:
        """The queue's settings (with a strategy defined in the config, from its own settings, as the router)."""
        return admission_settings(settings_for(strategy, self.routing, self.profiles))


@dataclass
class RequestRecord:
    arrival: float
    instance: str
    prompt_tokens: int
    reason: str
    first_token: float | None = None
    cached_tokens: int = 0
    done: float | None = None
    output_tokens: int = 0
    tag: str = ""  # the workload's request class ("hot", "shared", "chat", ...)
    sent: float = 0.0  # when it went to its instance (later than arrival if it waited in the router)
    tenant: str = ""
    prefill_instance: str = ""  # a split request's prefill leg's instance ("": sent whole)
    prefill_cached_tokens: int = 0  # of its prompt, what that instance had cached


@dataclass(frozen=True)
class ScaleIn:
    at: float
    instance: str
    unique_value: float | None  # its cached tokens no other instance held, per request (core/cache_value.py)


@dataclass
class SimResult:
    strategy: str
    records: list[RequestRecord]
    duration_s: float
    requests_per_instance: dict[str, int]
    hit_tokens: int
    query_tokens: int
    rejected: int = 0  # no instance at all, or refused by the router's queue (429)
    queued: int = 0  # requests that waited in the router's queue
    # Per scale event: (time, share of the prefixes requested again after it that went to another instance)
    prefixes_moved: list[tuple[float, float | None]] = field(default_factory=list)
    window_s: float = 10.0
    rejected_at: list[float] = field(default_factory=list)  # arrival time of each rejected request
    instance_seconds: float = 0.0  # from each instance's creation (start-up included) to its end (drained)
    fleet_sizes: list[tuple[float, int, int]] = field(default_factory=list)  # (t, ready, ready + starting)
    scale_ins: list[ScaleIn] = field(default_factory=list)
    autoscale: AutoscaleSettings | None = None  # the autoscaler's settings, if one ran
    rejected_by_tenant: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class _Instance:
    __slots__ = ("name", "model", "busy", "draining", "created", "joined", "ended", "busy_s", "busy_mark")

    def __init__(self, name: str, model: EngineModel, created: float = 0.0, joined: float = 0.0) -> None:
        self.name, self.model, self.busy, self.draining = name, model, False, False
        self.created, self.joined = created, joined  # its cost runs from creation; it takes requests from joining
        self.ended: float | None = None  # when its drain finished
        self.busy_s = self.busy_mark = 0.0  # seconds of engine steps; busy_s at the last autoscaler reading


class Simulation:
    ARRIVE, STEP, LANDED = 0, 1, 2

    def __init__(self, settings: SimSettings, workload: Workload, strategy: str | Strategy,
                 pooled: bool = False) -> None:
        self.s = settings
        self.workload = workload
        self.pooled = pooled
        self.cfg = settings.engine_config(settings.instances if pooled else 1)
        self.block_bytes = self.cfg.block_size * BYTES_PER_TOKEN  # the router's estimate of a block's bytes
        self.fleet = Fleet(FleetSettings(block_bytes=self.block_bytes, feedback=settings.feedback))
        self.instances: dict[str, _Instance] = {}
        self.strategy_name = "pooled" if pooled else (strategy if isinstance(strategy, str) else strategy.name)
        # Not for the pooled reference (one ideal instance) nor the peer model (its router has no such queue).
        self.admission_on = settings.admission.enabled and not pooled and self.strategy_name != "sglang_like"
        # What the strategy sees of the queue: how long a request waits for a slot at a full engine (built below).
        self.slot_wait = (lambda i: self.admission.slot_wait(i)) if self.admission_on else None
        for _ in range(1 if pooled else settings.instances):
            self._add_instance()
        if pooled:
            self.strategy = make_strategy("least_loaded")
        elif isinstance(strategy, str):
            self.strategy = make_strategy_for_sim(strategy, settings.routing, settings.seed, self)
        else:
            self.strategy = strategy
        self._heap: list[tuple[float, int, int, object]] = []
        self._wakeups: list[float] = []  # times at which a request may arrive (see _next_wakeup)
        self._order = itertools.count()
        self.records: list[RequestRecord] = []
        self._inflight: dict[int, tuple[RequestRecord, Lifecycle]] = {}
        self.now = 0.0  # the virtual clock, for the requests' lifecycles
        self._seq = itertools.count()
        self._rejected: dict[str, int] = {}  # per tenant
        self._last_instance_by_prefix: dict[int, str] = {}
        adm = settings.admission_settings(self.strategy_name)
        adm.enabled = self.admission_on
        adm.record_queued = self.strategy.records_prefixes
        self.admission = Admission(adm, self.fleet)
        self._queued = 0
        # Per scale event: its time, where each prefix seen before it last went, and where each of those first
        # went after it (the decisions made, so each strategy is measured on its own).
        self._moves: list[tuple[float, dict[int, str], dict[int, str]]] = []
        self._rejected_at: list[float] = []
        a = settings.autoscale
        self.autoscaler = Autoscaler(a) if a.autoscale and not pooled else None
        self.demand = DemandMeter(a.demand_window_s)  # fed only when an autoscaler reads it
        scaling = self.autoscaler is not None or bool(settings.scale_events)
        self.cache_value = CacheValue() if scaling and self.strategy.records_prefixes else None
        self._victim_rng = random.Random(f"scale-in-{settings.seed}")
        self._plans: dict[Lifecycle, Plan] = {}  # split requests' plans until their decode leg goes
        self._prefilling: dict[int, tuple[RequestRecord, Lifecycle, _Instance]] = {}  # prefill legs, by engine seq
        self._held: dict[int, tuple[_Instance, int]] = {}  # decode seq -> the prefill instance and seq holding its KV
        # Requests held for another's prefill of their prefix (Lifecycle.prefill_leader), as the router holds them:
        # engine seq -> (the leg waited for, its own leg, what sends it to its engine); and each leg's waiting seqs.
        self._holding: dict[int, tuple[Leg, Lifecycle, Leg, Callable[[float], None]]] = {}
        self._waiting_on: dict[Leg, list[int]] = {}
        hold = self.admission.settings.shared_prefill_wait_s
        self._hold_s = hold if self.admission_on and hold > 0 else 0.0
        self._starting: dict[int, float] = {}  # instances being started: id -> creation time
        self._starting_ids = itertools.count()
        self._cancelled_s = 0.0  # instance-seconds of starting instances cancelled before they were ready
        self._last_reading = 0.0
        self._sizes: list[tuple[float, int, int]] = []
        self._scale_ins: list[ScaleIn] = []

    # -- fleet membership ----------------------------------------------------------------------------------
    def _add_instance(self, created: float = 0.0, joined: float = 0.0) -> _Instance:
        name = f"instance-{len(self.instances)}"
        while name in self.instances:
            name += "+"
        inst = self.instances[name] = _Instance(name, EngineModel(self.cfg), created, joined)
        router_capacity = self.s.router_kv_capacity_tokens if not self.pooled else None
        role = "both" if self.pooled or not self.s.prefill_instances else \
            PREFILL if len(self.instances) <= self.s.prefill_instances else DECODE
        self.fleet.add(name, router_capacity or self.cfg.kv_capacity_tokens,
                       1000.0 / self.cfg.timing.prefill_ms_per_token, self.s.engine_capacity, role=role)
        return inst

    def _live(self) -> list[_Instance]:
        return [i for i in self.instances.values() if not i.draining]

    def _scale(self, now: float, delta: int) -> None:
        """A scale event given in advance (--scale-at)."""
        if delta > 0:
            self._join(now, now)
        elif len(live := self._live()) > 1:
            self._drain(now, *self._victim(live))

    def _join(self, now: float, created: float) -> None:
        inst = self._add_instance(created, now)
        self.fleet.start_ramp(inst.name, now)  # warm scale-out: its share ramps up (the strategy's slow_start)
        self._moves.append((now, dict(self._last_instance_by_prefix), {}))
        if self.admission.waiters:  # the router's queue polls: waiting requests may go to the new instance
            self._pump(now)

    def _victim(self, live: list[_Instance]) -> tuple[_Instance, float | None]:
        """The instance a scale-in drains, by the scale_in policy, and its cache value where it is known."""
        values = (self.cache_value.values(self.fleet.index, [i.name for i in live], self.fleet.block_tokens)
                  if self.cache_value is not None else {})
        policy = self.s.autoscale.scale_in
        if policy == CACHE_AWARE and values:
            victim = self.instances[scale_in_victim(values) or live[-1].name]
        elif policy == ARBITRARY:
            victim = self._victim_rng.choice(live)
        else:
            victim = live[-1]
        return victim, values.get(victim.name)

    def _drain(self, now: float, victim: _Instance, value: float | None) -> None:
        victim.draining = True
        self.fleet.remove(victim.name)  # no new requests; running ones finish on the model
        self.demand.forget(victim.name)
        if victim.model.idle:
            victim.ended = now
        self._scale_ins.append(ScaleIn(now, victim.name, value))
        self._moves.append((now, dict(self._last_instance_by_prefix), {}))

    # -- the autoscaler ------------------------------------------------------------------------------------------
    def _control(self, now: float, event: tuple) -> None:
        kind = event[0]
        if kind == "scale":
            self._scale(now, event[1])
        elif kind == "tick":
            self._tick(now)
        elif kind == "apply":
            self._apply(now, event[1])
        elif kind == "ready" and (created := self._starting.pop(event[1], None)) is not None:
            self._join(now, created)
        elif kind == "scrape":
            self._scrape(now)
        elif kind == "unhold" and (held := self._holding.pop(event[1], None)) is not None:
            leader, life, leg, submit = held
            self._waiting_on[leader].remove(event[1])
            self._resume(now, life, leg, submit)

    def _hold_or_submit(self, now: float, seq: int, life: Lifecycle, leg: Leg, submit: Callable[[float], None]) -> None:
        """Send a leg to its engine now, or hold it while another request there computes its prefix (for at most
        shared_prefill_wait_s), as the router does (Router.hold_for_prefill)."""
        leader = life.prefill_leader(leg) if self._hold_s else None
        if leader is None:
            submit(now)
            return
        self._holding[seq] = (leader, life, leg, submit)
        self._waiting_on.setdefault(leader, []).append(seq)
        self._push(now + self._hold_s, self.ARRIVE, ("unhold", seq))

    def _prefill_over(self, now: float, leg: Leg) -> None:
        """`leg`'s first token: the requests held for its prefill go."""
        for seq in self._waiting_on.pop(leg, ()):
            _, life, held, submit = self._holding.pop(seq)
            self._resume(now, life, held, submit)

    @staticmethod
    def _resume(now: float, life: Lifecycle, leg: Leg, submit: Callable[[float], None]) -> None:
        life.resumed(leg)
        submit(now)

    def _scrape(self, now: float) -> None:
        """The router reads each engine's running batch, queue and KV usage, as it scrapes /metrics (the load
        routing weighs, the capacity the queue holds requests at); it may then send more of the requests waiting in
        its queue (the engines' capacity moved)."""
        for i in self._live():
            self.fleet.engine_load(i.name, i.model.num_waiting, i.model.num_running, i.model.kv_usage)
        if self.admission.waiters:
            self._pump(now)
        if self._pending_work():
            self._push(now + self.s.scrape_interval_s, self.ARRIVE, ("scrape",))

    def _pending_work(self) -> bool:
        """Whether a request is still to come or running (periodic events stop with the last of them)."""
        return any(kind == self.STEP or not isinstance(p[0], str) for _, _, kind, p in self._heap)  # type: ignore

    def _tick(self, now: float) -> None:
        """One reading of the signal; the change it asks for happens reaction_delay_s later."""
        assert self.autoscaler is not None
        a = self.s.autoscale
        live = self._live()
        provisioned = len(live) + len(self._starting)
        self._sizes.append((now, len(live), provisioned))
        target = self.autoscaler.decide(now, len(live), provisioned, self._signal(now, live))
        self._push(now + a.reaction_delay_s, self.ARRIVE, ("apply", target))
        if self._pending_work():
            self._push(now + a.interval_s, self.ARRIVE, ("tick",))  # until no request is left

    def _signal(self, now: float, live: list[_Instance]) -> float:
        since, self._last_reading = self._last_reading, now
        if self.s.autoscale.autoscale == DEMAND:
            return self._demand_ratio(now, live)
        busy = []
        for i in live:  # the share of the interval (or of its time in the fleet) its engine was stepping
            span = now - max(since, i.joined)
            busy.append(min(1.0, (i.busy_s - i.busy_mark) / span) if span > 0 else 0.0)
            i.busy_mark = i.busy_s
        return sum(busy) / len(busy) if busy else 0.0

    def _demand_ratio(self, now: float, live: list[_Instance]) -> float:
        waiting = self.admission.waiting_for()
        threshold, scale = self.s.routing.concurrency_threshold, self.fleet.cache_scale.value
        demands = [self.demand.instance_demand(self.fleet.instances[i.name], now, threshold,
                                               *waiting.get(i.name, (0, 0.0)), capacity_scale=scale) for i in live]
        return fleet_demand(demands, self.s.autoscale.backlog_horizon_s).ratio

    def _apply(self, now: float, target: int) -> None:
        """Start instances (ready startup_s later), or cancel starting ones and drain ready ones, to reach target."""
        live = self._live()
        provisioned = len(live) + len(self._starting)
        for _ in range(target - provisioned):
            sid = next(self._starting_ids)
            self._starting[sid] = now
            self._push(now + self.s.autoscale.startup_s, self.ARRIVE, ("ready", sid))
        excess = provisioned - target
        while excess > 0 and self._starting:
            _, created = self._starting.popitem()  # the newest first
            self._cancelled_s += now - created
            excess -= 1
        while excess > 0 and len(live) > 1:
            victim, value = self._victim(live)
            self._drain(now, victim, value)
            live.remove(victim)
            excess -= 1

    def _instance_seconds(self, end: float) -> float:
        spent = self._cancelled_s + sum(max(0.0, end - created) for created in self._starting.values())
        return spent + sum(max(0.0, min(end, i.ended if i.ended is not None else end) - i.created)
                           for i in self.instances.values())

    def _note_prefix(self, prefix: int, instance: str) -> None:
        self._last_instance_by_prefix[prefix] = instance
        for _, before, after in self._moves:
            if prefix in before and prefix not in after:
                after[prefix] = instance

    def _moved(self) -> list[tuple[float, float | None]]:
        """Per scale event, the share of the prefixes sent again after it whose first request after it went to
        another instance than their last one before it (None: none was sent again)."""
        return [(t, sum(after[k] != before[k] for k in after) / len(after) if after else None)
                for t, before, after in self._moves]

    # -- event loop ------------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (t, next(self._order), kind, payload))
        if kind == self.ARRIVE:
            heapq.heappush(self._wakeups, t)

    def _next_wakeup(self, now: float) -> float | None:
        """The next time a request can arrive: a scheduled arrival, or a step that finishes a sequence
        (closed-loop clients and the next turn of a conversation arrive then). Other steps change nothing
        another instance's fused decode run could depend on."""
        w = self._wakeups
        while w and w[0] < now:
            heapq.heappop(w)
        return w[0] if w else None

    def run(self) -> SimResult:
        rng = random.Random(self.s.seed)
        sessions = self.workload.sessions()
        budget = [self.s.requests]
        started = self._start_sessions(sessions, rng, budget)
        for t, delta in self.s.scale_events:
            self._push(t, self.ARRIVE, ("scale", delta))
        if self.autoscaler is not None:
            self._push(self.s.autoscale.interval_s, self.ARRIVE, ("tick",))
        if self.admission_on:
            self._push(self.s.scrape_interval_s, self.ARRIVE, ("scrape",))
        now = 0.0
        while self._heap:
            now, _, kind, payload = heapq.heappop(self._heap)
            self.now = now
            if kind == self.STEP:
                self._on_step_done(now, payload)  # type: ignore[arg-type]
            elif kind == self.LANDED:
                self._on_landed(now, payload)  # type: ignore[arg-type]
            elif isinstance(payload, tuple) and isinstance(payload[0], str):
                self._control(now, payload)
            else:
                self._on_arrival(now, *payload)  # type: ignore[misc]
            if started is not None:
                started = started(now)
        hits = sum(i.model.stats.prefix_hits for i in self.instances.values())
        queries = sum(i.model.stats.prefix_queries for i in self.instances.values())
        per_instance = {i.name: 0 for i in self.instances.values()}
        for r in self.records:
            per_instance[r.instance] += 1
        end = max((r.done or r.arrival) for r in self.records) if self.records else 0.0
        return SimResult(self.strategy_name, self.records, end, per_instance, hits, queries,
                         sum(self._rejected.values()), self._queued, self._moved(), self.s.window_s,
                         self._rejected_at, self._instance_seconds(end), self._sizes, self._scale_ins,
                         self.s.autoscale if self.autoscaler is not None else None, dict(self._rejected))

    def _start_sessions(self, sessions: Iterator[Session], rng: random.Random,
                        budget: list[int]) -> Callable[[float], object] | None:
        """Schedule session arrivals. Returns a feeder called after each event (open loop), or None."""
        s = self.s
        if s.concurrency:
            for _ in range(s.concurrency):
                self._begin_session(0.0, sessions, budget)
            self._closed_loop = (sessions, budget)
            return None
        self._closed_loop = None
        clock = [0.0]

        def feed(now: float) -> Callable[[float], object] | None:
            # Keep one future session arrival in the heap, so memory stays flat for 100k requests.
            while budget[0] > 0:
                session = next(sessions, None)
                if session is None:
                    return None
                if session.arrival_s is not None and not s.rate:
                    t = session.arrival_s / s.speedup
                else:
                    clock[0] += rng.expovariate(s.rate or 1.0)
                    t = clock[0]
                if s.rate_shape is not None:
                    t = s.rate_shape.time_of(t)
                    if t == math.inf:  # the shape's end: no more arrivals
                        return None
                self._schedule_session(t, session, budget)
                if t > now:
                    return feed
            return None

        return feed(0.0)

    def _begin_session(self, now: float, sessions: Iterator[Session], budget: list[int]) -> None:
        if budget[0] <= 0:
            return
        session = next(sessions, None)
        if session is not None:
            self._schedule_session(now, session, budget)

    def _schedule_session(self, t: float, session: Session, budget: list[int]) -> None:
        requests = session.requests[: budget[0]]  # the last conversation may be cut short: exactly N requests
        budget[0] -= len(requests)
        turns = iter(requests)
        first = next(turns)
        self._push(t, self.ARRIVE, (first, turns, budget))

    def _on_arrival(self, now: float, req: WorkloadRequest, turns: Iterator[WorkloadRequest] | None,
                    budget: list[int] | None) -> None:
        """Route a request: to its instance now, or into the router's queue (core/admission/)."""
        life = Lifecycle(self.fleet, self.admission, self._clock, records_prefixes=self.strategy.records_prefixes)
        life.shell = (req, turns)
        life.keyed(key := key_for_json(req.path, req.body), req.tenant)
        self.fleet.now = now  # the core reads no clock: slow start's ramps are timed by the shell's
        try:
            d, pool = self._choose(life, key)
        except NoInstanceAvailable:
            life.refuse()
            self._count_rejected(req.tenant)
            self._rejected_at.append(now)
            return
        try:
            refused = life.admit(d, now, pool=pool)
        except QueueFull:
            self._queued += 1
            assert life.waiter is not None
            self._refuse(now, life.waiter)
        else:
            if life.waiter is None:
                self._send(now, now, life, d)
                return
            self._queued += 1
            for w in refused:
                self._shed(now, w)
        self._pump(now)

    def _choose(self, life: Lifecycle, key: RoutingKey) -> tuple[Decision, str]:
        """The strategy's choice and the pool it is in; in a disaggregated fleet, the first leg of the plan (kept
        for `_send`)."""
        if not self.fleet.disaggregated:
            return self.strategy.choose(key, self.fleet), ""
        p = plan(self.strategy, key, self.fleet, self.s.pd)
        if p.split:
            self._plans[life] = p
        return p.first, p.pool

    def _pump(self, now: float) -> None:
        """Instances with room take the waiting requests the admission queue gives them."""
        self.fleet.now = now
        assigned, shed = self.admission.pump(now)
        for w in shed:
            self._shed(now, w)
        for w in assigned:
            life: Lifecycle = w.payload  # type: ignore[assignment]
            assert w.instance is not None and life.key is not None
            d = decide_at(self.strategy, life.key, self.fleet, w.instance, w.first)
            life.assigned()
            self._send(now, w.enqueued, life, d)

    def _clock(self) -> float:
        return self.now

    def _shed(self, now: float, w: Waiter) -> None:
        """The queue turned a waiting request away."""
        w.payload.shed()  # type: ignore[union-attr]
        self._refuse(now, w)

    def _refuse(self, now: float, w: Waiter) -> None:
        """The router answered 429 (or 503): a closed-loop client moves on to its next session."""
        self._count_rejected(w.tenant)
        self._rejected_at.append(w.enqueued)
        if self._closed_loop is not None:
            self._begin_session(now, *self._closed_loop)

    def _count_rejected(self, tenant: str) -> None:
        self._rejected[tenant] = self._rejected.get(tenant, 0) + 1

    def _send(self, now: float, arrival: float, life: Lifecycle, d: Decision) -> None:
        key, (req, _) = life.key, life.shell
        assert key is not None
        plan = self._plans.pop(life, None)
        if plan is not None:
            self._send_prefill(now, arrival, life, d)
            return
        self._note_prefix(key.prefix_hash(self.s.routing.prefix_length), d.instance)
        leg = life.dispatch(d)
        if self.autoscaler is not None:
            self.demand.dispatched(self.fleet.instances[d.instance], now, d.uncached_tokens)
        if self.cache_value is not None and d.blocks:
            self.cache_value.requested(d.blocks)
        rec = RequestRecord(arrival, d.instance, key.tokens, d.reason, tag=req.tag, sent=now, tenant=req.tenant)
        self.records.append(rec)
        seq = next(self._seq)
        self._inflight[seq] = (rec, life)
        submit = partial(self._submit, self.instances[d.instance], seq, rec, key, max(1, req.max_tokens), False)
        self._hold_or_submit(now, seq, life, leg, submit)

    # -- a split request (core/disaggregation.py): prefill here, then its KV moves to the decode instance -------
    def _send_prefill(self, now: float, arrival: float, life: Lifecycle, d: Decision) -> None:
        """The prefill leg: one token computed, its prompt's blocks held for the decode instance to read."""
        key, (req, _) = life.key, life.shell
        assert key is not None
        self._note_prefix(key.prefix_hash(self.s.routing.prefix_length), d.instance)
        leg = life.dispatch(d, role=PREFILL)
        rec = RequestRecord(arrival, "", key.tokens, d.reason, tag=req.tag, sent=now, tenant=req.tenant,
                            prefill_instance=d.instance)
        self.records.append(rec)
        seq = next(self._seq)
        inst = self.instances[d.instance]
        self._prefilling[seq] = (rec, life, inst)
        self._hold_or_submit(now, seq, life, leg, partial(self._submit, inst, seq, rec, key, 1, True))

    def _submit(self, inst: _Instance, seq: int, rec: RequestRecord, key: RoutingKey, max_tokens: int,
                hold: bool, at: float) -> None:
        """A leg reaches its engine at `at` (`hold`: a prefill leg, whose blocks stay for its decode instance)."""
        rec.sent = at
        inst.model.submit(seq, self._engine_blocks(key), key.tokens, max_tokens, hold=hold)
        if not inst.busy:
            self._start_step(at, inst)

    def _send_decode(self, now: float, life: Lifecycle, rec: RequestRecord, prefill: _Instance, pseq: int) -> None:
        """The decode leg, once the prefill leg has answered: admitted there, it loads the KV it lacks."""
        key, (req, _) = life.key, life.shell
        assert key is not None
        self.fleet.now = now
        try:
            d = decode_after(self.strategy, key, self.fleet, prefill.name)
        except NoInstanceAvailable:
            prefill.model.release(pseq)
            life.finish()
            self._count_rejected(req.tenant)
            self._rejected_at.append(rec.arrival)
            return
        life.dispatch(d, role=DECODE)
        rec.instance, rec.reason = d.instance, SPLIT
        seq = next(self._seq)
        self._inflight[seq] = (rec, life)
        self._held[seq] = (prefill, pseq)
        inst = self.instances[d.instance]
        inst.model.submit(seq, self._engine_blocks(key), key.tokens, max(1, req.max_tokens), remote=True)
        if not inst.busy:
            self._start_step(now, inst)

    def _on_landed(self, now: float, payload: tuple[_Instance, int]) -> None:
        """A decode leg's KV arrived: the prefill instance lets its blocks go, and the decode instance runs it."""
        inst, seq = payload
        prefill, pseq = self._held.pop(seq)
        prefill.model.release(pseq)
        if inst.model.loaded(seq) and not inst.busy:
            self._start_step(now, inst)

    def _engine_blocks(self, key: RoutingKey) -> list[int]:
        """The engine model is fed the routing key's blocks and ~4-byte tokens, not a tokenizer's (too slow for
        100,000 requests): here, unlike over HTTP, router and engine agree on what a prefix is."""
        blocks = key.blocks(self.block_bytes)
        return blocks[: key.tokens // self.cfg.block_size]

    def _start_step(self, now: float, inst: _Instance) -> None:
        if inst.model.stalled:  # idle, or only waiting for KV to arrive (`_on_landed` starts it again)
            inst.busy = False
            if inst.draining and inst.ended is None:
                inst.ended = now
            return
        k = 1
        fusible = inst.model.fusible_decode_steps()
        if fusible > 1:
            horizon = self._next_wakeup(now)
            if horizon is not None:  # fuse no further than the next event that can route a request here
                fusible = min(fusible, int((horizon - now) / inst.model.decode_step_seconds))
            k = max(1, fusible)
        result = inst.model.step(k)
        inst.busy = True
        inst.busy_s += result.duration
        self._push(now + result.duration, self.STEP, (inst, result))
        if result.finished:
            heapq.heappush(self._wakeups, now + result.duration)

    def _on_step_done(self, now: float, payload: tuple[_Instance, object]) -> None:
        inst, result = payload
        for seq, tokens in result.loads.items():  # type: ignore[attr-defined]
            moved = self.s.transfer_latency_s + tokens / self.s.transfer_tokens_per_s
            self._push(now + moved, self.LANDED, (inst, seq))
        for seq, cached in result.first_tokens.items():  # type: ignore[attr-defined]
            if seq in self._prefilling:
                rec, life, _ = self._prefilling[seq]
                rec.prefill_cached_tokens = cached
                self._prefill_over(now, life.first_token())
                life.feedback(cached)
                continue
            rec, life = self._inflight[seq]
            rec.first_token, rec.cached_tokens = now, cached
            leg = life.first_token()
            self._prefill_over(now, leg)
            books = self.fleet.instances.get(inst.name)
            if self.autoscaler is not None and books is not None and not leg.queued_ahead:
                # Nothing was queued ahead of it there: its time to first token was its own prefill.
                self.demand.first_token(books, now, rec.prompt_tokens - cached, now - rec.sent)
            life.feedback(cached)  # the engine reports cached tokens at first token
        for seq, n in result.tokens.items():  # type: ignore[attr-defined]
            if seq not in self._prefilling:  # a prefill leg's one token is not the answer's
                self._inflight[seq][0].output_tokens += n
        for seq in result.finished:  # type: ignore[attr-defined]
            if seq in self._prefilling:
                rec, life, prefill = self._prefilling.pop(seq)
                life.handover()
                self._send_decode(now, life, rec, prefill, seq)
                continue
            rec, life = self._inflight.pop(seq)
            rec.done = now
            life.finish()
            turns = life.shell[1]
            nxt = next(turns, None) if turns is not None else None
            if nxt is not None:
                self._push(now, self.ARRIVE, (nxt, turns, None))
            elif self._closed_loop is not None:
                self._begin_session(now, *self._closed_loop)
        self._start_step(now, inst)
        freed = bool(result.finished)  # type: ignore[attr-defined]
        if self.admission.caps_queues:  # a first token shortens the engine's queue: capped tenants go
            freed = freed or bool(result.first_tokens)  # type: ignore[attr-defined]
        if freed and (self.admission.waiters or self.admission.reserved):
            self._pump(now)


def make_strategy_for_sim(name: str, settings: StrategySettings, seed: int, sim: Simulation) -> Strategy:
    if name == "oracle":
        from warmroute.sim.references import oracle
        return oracle(settings, {n: i.model for n, i in sim.instances.items()}, sim.slot_wait)
    if name == "sglang_like":
        from warmroute.sim.references import sglang_like
        return sglang_like(settings)
    return make_strategy(name, settings, handles=Handles(seed=seed, slot_wait=sim.slot_wait),
                         profiles=sim.s.profiles)
