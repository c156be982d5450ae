"""The host set: every instance the router knows, its health and its load, plus the prefix index.

Membership, health and load live here; strategies only read them (Envoy's split between the host set and
the load-balancing policy). The I/O shell and the simulator report what happens through `dispatched`,
`first_token`, `finished` and `feedback` (the cached tokens the engine reported), so both keep identical books.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from warmroute.core import feedback as fb
from warmroute.core.engine_capacity import EngineCapacity
from warmroute.core.engine_load import EngineLoad, foreign_requests, observe
from warmroute.core.fading import FadingUnit
from warmroute.core.block_hash import BLOCK_BYTES_DEFAULT
from warmroute.core.prefills import Prefills
from warmroute.core.prefix_index import BYTES_PER_ENTRY, PrefixIndex
from warmroute.core.routing_key import BYTES_PER_TOKEN


INDEX_FULL = 0.9  # an instance's index counts as full (evicting) from this share of its capacity
MEAN_DECAY = 0.01  # weight of one request in the running mean of uncached prompt tokens
RECENT_WINDOW = 64  # requests per instance over which `Instance.recent` fades (by 1/e)


@dataclass(slots=True)  # slots: the compiled routable filter reads its fields at their offsets (core/_scan.c)
class Instance:
    name: str
    kv_capacity_tokens: int
    prefill_tokens_per_s: float = 10_000.0
    healthy: bool = True
    draining: bool = False
    inflight: int = 0
    queued_prefill_tokens: float = 0.0  # uncached prompt tokens sent here that have not had a first token
    pending: int = 0  # requests sent here that have not had a first token
    # Prompt tokens of the requests in flight here: the KV cache they will need (Decision.kv_tokens: a prefix
    # they share counted once, as cached). Above the instance's capacity, histories of requests still queued
    # get evicted before their turn.
    inflight_prompt_tokens: int = 0
    requests_total: int = 0
    recent: float = 0.0  # requests sent here lately, fading (in units of Fleet.recent_unit.value)
    engine: EngineLoad | None = None  # load the engine itself reports (scraped /metrics); None: unknown
    models: frozenset[str] | None = None  # the models it serves (its /v1/models, or configured); None: unknown
    # Requests the engine runs before it queues them (stated, or learned from its scrapes): the admission queue's
    # room; unknown, the router never holds a request back for it.
    capacity: EngineCapacity = field(default_factory=EngineCapacity)
    # Its part in disaggregated serving (core/disaggregation.py): "prefill", "decode", or "both" (the usual: it
    # serves whole requests, and either leg of a split one).
    role: str = "both"

    @property
    def load(self) -> float:
        """Requests in flight at the engine as far as the router knows: its own, and other routers' where the engine
        reports them."""
        return self.inflight + foreign_requests(self.engine)

    @property
    def routable(self) -> bool:  # Fleet.routable() spells this out for speed: change both together
        return self.healthy and not self.draining


def routable_python(instances: dict[str, Instance], serving: frozenset[str] | None) -> list[Instance]:
    """The instances that take requests: healthy, not draining, and in `serving` unless it is None."""
    if serving is None:  # the usual case: every instance may serve it (no lists, or a homogeneous fleet)
        # Instance.routable spelt out: a property call per instance would be most of this filter's time.
        return [i for i in instances.values() if i.healthy and not i.draining]
    return [i for i in instances.values() if i.healthy and not i.draining and i.name in serving]


# Compiled where a C compiler was found (core/_scan.c), because it runs on every decision: it reads the two fields
# at their slots once stages/compiled.py has configured _scan with Instance's layout (before that, through getattr:
# slower, same answer). The same list in the same order (tests/core/test_compiled_primitives.py).
try:
    if os.environ.get("WARMROUTE_PURE_PYTHON") == "1":  # to run (and test) the fallback where the C one exists
        raise ImportError("WARMROUTE_PURE_PYTHON=1")
    from warmroute.core._scan import routable as routable_of
except ImportError:
    routable_of = routable_python


@dataclass
class FleetSettings:
    block_bytes: int = BLOCK_BYTES_DEFAULT
    index_max_bytes: int = 256 * 1024 * 1024
    default_kv_capacity_tokens: int = 1_000_000
    default_prefill_tokens_per_s: float = 10_000.0
    feedback: bool = True  # let engine reports correct the index (off: verdicts are only returned)


@dataclass
class Fleet:
    settings: FleetSettings = field(default_factory=FleetSettings)
    instances: dict[str, Instance] = field(default_factory=dict)
    index: PrefixIndex = field(init=False)
    # The prefixes each instance is computing now for requests without a first token (core/prefills.py)
    prefills: Prefills = field(default_factory=Prefills, init=False)
    cache_scale: fb.CapacityScale = field(default_factory=fb.CapacityScale)  # learnt from engine feedback
    mean_uncached_tokens: float = 0.0  # per request sent, a running mean (sizes other routers' queued requests)
    # Seconds from sending a request to its first token, a running mean over the fleet (how long cache_aware
    # lets a held request keep its instance scales with it: CacheAwareSettings.hold_keep); 0 until measured.
    mean_ttft_s: float = 0.0
    _ttft_seen: int = field(default=0, init=False, repr=False)
    # Seconds from sending a request to its end, a running mean over the fleet (how soon a full engine frees a slot:
    # Admission.slot_wait); 0 until measured.
    mean_service_s: float = 0.0
    _service_seen: int = field(default=0, init=False, repr=False)
    recent_unit: FadingUnit = field(default_factory=FadingUnit, init=False)  # the unit of Instance.recent
    # The shell's clock at the decision being made (seconds; the router's monotonic time, the simulator's virtual
    # time): the core reads no clock, so the shell sets it before it asks for a decision.
    now: float = 0.0
    # Instances in their slow-start ramp: name -> when it began (`start_ramp`; read by stages/slow_start.py).
    ramps: dict[str, float] = field(default_factory=dict, init=False)
    # Whether any instance has a part of its own in disaggregated serving (prefill or decode only): kept by `add` and
    # `remove`, read on every request.
    disaggregated: bool = field(default=False, init=False)
    # model -> names of the instances that may serve it, or None where any may (see `serving`); rebuilt lazily
    _serving: dict[str, frozenset[str] | None] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.index = PrefixIndex(max(1, self.settings.index_max_bytes // BYTES_PER_ENTRY))

    @property
    def block_tokens(self) -> int:
        return self.settings.block_bytes // BYTES_PER_TOKEN

    # -- membership -------------------------------------------------------------------------------------
    def add(self, name: str, kv_capacity_tokens: int | None = None,
            prefill_tokens_per_s: float | None = None, engine_capacity: int | None = None,
            role: str | None = None) -> Instance:
        """Adds (or updates) an instance; `engine_capacity`: the requests it runs at once, if the operator said;
        `role`: its part in disaggregated serving (None: unchanged, "both" for a new one)."""
        s = self.settings
        inst = self.instances.get(name)
        if inst is None:
            inst = self.instances[name] = Instance(
                name, kv_capacity_tokens or s.default_kv_capacity_tokens,
                prefill_tokens_per_s or s.default_prefill_tokens_per_s)
        elif kv_capacity_tokens:
            inst.kv_capacity_tokens = kv_capacity_tokens
        if engine_capacity is not None:
            inst.capacity.stated = engine_capacity
        if role is not None:
            inst.role = role
            self.disaggregated = any(i.role != "both" for i in self.instances.values())
        self.index.add_instance(name, self.estimated_capacity_tokens(name) // self.block_tokens)
        self._serving.clear()
        return inst

    def remove(self, name: str) -> None:
        self.instances.pop(name, None)
        self.ramps.pop(name, None)
        self.index.remove_instance(name)
        self.prefills.forget(name)
        self._serving.clear()
        self.disaggregated = any(i.role != "both" for i in self.instances.values())

    def routable(self, model: str | None = None) -> list[Instance]:
        """Healthy, not draining, and (for a request naming a model) among the instances that may serve it."""
        serving = self.serving(model) if model is not None else None
        return routable_of(self.instances, serving)

    def sole_server(self, name: str) -> bool:
        """Whether `name` is routable and taking it out would leave the fleet, or a model it serves, with no
        routable instance (an instance with no model list may serve any model)."""
        inst = self.instances.get(name)
        if inst is None or not inst.routable:
            return False
        others = [i for i in self.routable() if i.name != name]
        if inst.models is None:
            return not others
        return any(not any(o.models is None or model in o.models for o in others) for model in inst.models)

    def start_ramp(self, name: str, now: float) -> None:
        """`name` just became routable (joined, or healthy again) while the fleet serves: it takes traffic
        gradually from `now` (slow start). Its count of recent requests restarts, so its share is measured from
        here, not from before it went down."""
        inst = self.instances.get(name)
        if inst is not None:
            self.ramps[name] = now
            inst.recent = 0.0

    def ramping(self, window: float) -> dict[str, float]:
        """Seconds since each ramp began, for the instances still within `window` of theirs (older ramps are
        over and dropped)."""
        now, ramps = self.now, self.ramps
        over = [n for n, t in ramps.items() if now - t >= window or n not in self.instances]
        for n in over:
            del ramps[n]
        return {n: now - t for n, t in ramps.items()}

    # -- which instance serves which model ------------------------------------------------------------------
    def set_models(self, name: str, models: frozenset[str] | None) -> None:
        """What an instance serves (None: unknown). Instances of one fleet may serve different models (or
        LoRA adapters): a request naming a model then goes only to those that list it."""
        inst = self.instances.get(name)
        if inst is not None and inst.models != models:
            inst.models = models
            self._serving.clear()

    def serving(self, model: str) -> frozenset[str] | None:
        """Names of the instances that may serve `model`: those that list it, and those whose list is unknown.
        None (no restriction) when every instance may, or when no instance lists it: a name no engine reports
        may still be one an engine accepts (llama.cpp serves any name), so the router does not refuse it."""
        if model in self._serving:
            return self._serving[model]
        if len(self._serving) > 1024:  # bounded: request bodies choose the model names
            self._serving.clear()
        listed = {n for n, i in self.instances.items() if i.models is not None and model in i.models}
        unknown = {n for n, i in self.instances.items() if i.models is None}
        names = frozenset(listed | unknown)
        result = None if not listed or len(names) == len(self.instances) else names
        self._serving[model] = result
        return result

    def estimated_capacity_tokens(self, name: str) -> int:
        """The prefix cache the index models for an instance: its configured capacity x the learnt scale."""
        inst = self.instances.get(name)
        return int(inst.kv_capacity_tokens * self.cache_scale.value) if inst is not None else 0

    # -- load accounting --------------------------------------------------------------------------------
    def dispatched(self, name: str, uncached_tokens: int, blocks: Sequence[int] | None = None,
                   prompt_tokens: int = 0) -> int:
        """A request was sent to `name`; its blocks are now (about to be) cached there. Returns how many
        requests sent there before it still wait for their first token (for `feedback`'s queued_ahead)."""
        inst = self.instances.get(name)
        if inst is None:
            return 0
        queued_ahead = inst.pending
        inst.inflight += 1
        inst.inflight_prompt_tokens += prompt_tokens
        inst.pending += 1
        inst.requests_total += 1
        inst.recent += self.recent_unit.value
        factor = self.recent_unit.advance(RECENT_WINDOW * len(self.instances))
        if factor is not None:
            for i in self.instances.values():
                i.recent /= factor
        inst.queued_prefill_tokens += uncached_tokens
        self.mean_uncached_tokens += MEAN_DECAY * (uncached_tokens - self.mean_uncached_tokens)
        if blocks:
            self.index.record(name, blocks)
        return queued_ahead

    def waiting(self, name: str, uncached_tokens: int, blocks: Sequence[int], cached_blocks: int,
                joined: bool) -> None:
        """A request began (`joined`) or ended waiting in the router for `name`. Its prefill counts as queued there
        meanwhile (cache_aware's cost reads it: requests that could go elsewhere see the router's queue too), and
        its chain (`blocks`, empty: none) is recorded there: its prefix will be computed there, so the requests
        sharing it that arrive meanwhile wait there too (recorded only when sent, they scattered). When it leaves,
        what was not cached before (beyond `cached_blocks`) is forgotten: the shell records what it sends; left
        in, its own prediction at dispatch would count it as cached, and the engine's report that it was not would
        shrink the index's model of the cache."""
        inst = self.instances.get(name)
        if inst is not None:
            change = uncached_tokens if joined else -uncached_tokens
            inst.queued_prefill_tokens = max(0.0, inst.queued_prefill_tokens + change)
        if joined and blocks:
            self.index.record(name, blocks)
        elif blocks and cached_blocks < len(blocks):
            self.index.forget(name, blocks[cached_blocks:])

    def first_token(self, name: str, uncached_tokens: int, seconds: float | None = None) -> None:
        """Its prefill is done: the work no longer queues ahead of later requests. `seconds`: since it was sent,
        where the caller measured it (into mean_ttft_s)."""
        inst = self.instances.get(name)
        if inst is not None:
            inst.queued_prefill_tokens = max(0.0, inst.queued_prefill_tokens - uncached_tokens)
            inst.pending = max(0, inst.pending - 1)
        if seconds is not None and seconds >= 0.0:
            self._ttft_seen += 1  # a plain mean of the first 100, then a running one
            self.mean_ttft_s += max(MEAN_DECAY, 1.0 / self._ttft_seen) * (seconds - self.mean_ttft_s)

    def finished(self, name: str, uncached_tokens: int = 0, got_first_token: bool = True,
                 blocks: Sequence[int] | None = None, prompt_tokens: int = 0, seconds: float | None = None) -> None:
        """The request is done. Its blocks are refreshed in the index: engines free a finished sequence's
        blocks to the most-recent end of their LRU, so that is when they become the last to be evicted.
        `seconds`: since it was sent, where the caller measured it and it was answered (into mean_service_s)."""
        inst = self.instances.get(name)
        if inst is None:
            return
        if seconds is not None and seconds >= 0.0 and got_first_token:
            self._service_seen += 1  # a plain mean of the first 100, then a running one
            self.mean_service_s += max(MEAN_DECAY, 1.0 / self._service_seen) * (seconds - self.mean_service_s)
        inst.inflight = max(0, inst.inflight - 1)
        inst.inflight_prompt_tokens = max(0, inst.inflight_prompt_tokens - prompt_tokens)
        if not got_first_token:
            self.first_token(name, uncached_tokens)
        if blocks and got_first_token:
            self.index.record(name, blocks)

    # -- what the engines report ---------------------------------------------------------------------------
    def engine_load(self, name: str, waiting: int | None, running: int | None, kv_usage: float | None) -> None:
        """A scrape of the engine's own load (all None: unknown, routing falls back to the router's books)."""
        inst = self.instances.get(name)
        if inst is None:
            return
        if waiting is None and running is None and kv_usage is None:
            inst.engine = None
        else:
            inst.engine = observe(waiting, running, kv_usage, inst.inflight, inst.pending)
        self.observe_capacity(name, waiting, running, kv_usage)

    def observe_capacity(self, name: str, waiting: int | None, running: int | None,
                         kv_usage: float | None = None) -> None:
        """A scrape's queue, batch and KV usage, for the requests the engine runs at once (EngineCapacity)."""
        inst = self.instances.get(name)
        if inst is not None:
            learned = inst.capacity.learned
            inst.capacity.observe(waiting, running, learned is not None and inst.load >= learned, kv_usage)

    def feedback(self, name: str, blocks: Sequence[int], predicted_tokens: int, cached_tokens: int,
                 engine_prompt_tokens: int | None = None, prompt_tokens: int | None = None,
                 queued_ahead: int = 0) -> fb.Verdict:
        """The engine reported `cached_tokens` for a request routed to `name` with this chain, where the index
        had predicted `predicted_tokens`: correct the index's idea of that instance's cache. `queued_ahead`:
        requests sent there before this one that had no first token yet when it was sent."""
        bt = self.block_tokens
        prompt_tokens = prompt_tokens or len(blocks) * bt
        reported = fb.reported_blocks(cached_tokens, engine_prompt_tokens, prompt_tokens, bt, len(blocks))
        predicted = predicted_tokens // bt
        tolerance = fb.tolerance_blocks(predicted, engine_prompt_tokens, prompt_tokens, bt)
        verdict = fb.judge(predicted, reported, tolerance)
        if name not in self.instances or not self.settings.feedback:
            return verdict
        # The chain itself is held now either way (the engine just computed it), so it stays recorded; a wrong
        # prediction says the index models the caches as too large or too small: rescale them all (see
        # core/feedback.py). An underprediction while the index is still refilling after a shrink is no evidence.
        # An overprediction for a request that queued behind others is no evidence either: the engine may have
        # evicted the blocks to admit the requests ahead of it (a busy engine's free cache churns; its size did
        # not change). Shrinking on those made the index forget live conversations under load (docs/feedback.md).
        under = verdict.kind == fb.UNDERPREDICTED
        evidence = (verdict.kind == fb.OVERPREDICTED and not queued_ahead) or (under and self._index_full(name))
        if under:
            self.index.record(name, blocks[:reported])
        if evidence and self.cache_scale.update(verdict):
            for other in self.instances:
                self.index.resize_instance(other, self.estimated_capacity_tokens(other) // bt)
        return verdict

    def _index_full(self, name: str) -> bool:
        return self.index.entries(name) >= INDEX_FULL * self.index.capacity(name)
