"""Where the router decides: request body -> routing key -> the strategy's choice, plus the fleet's books.

This is the shell's only contact with the pure core (warmroute/core): it builds the key, asks the strategy,
and keeps each request's books through its `Lifecycle` (core/lifecycle.py), so the index and load figures the
strategy reads stay true.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from warmroute.core.admission import (DEADLINE, IMMEDIATE, NO_INSTANCE, PREEMPTED, QUEUE_FULL, Admission,
                                      QueueFull, Waiter, admission_settings, decide_at)
from warmroute.core.exact_index import BYTES_PER_BLOCK, ExactIndex, token_seed
from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.lifecycle import Hooks, Leg, Lifecycle
from warmroute.core.routing_key import (CHAT_ROUTES, PROMPT_ROUTES, RAW_ROUTES, ROUTED_PATHS, KeyError_, RoutingKey,
                                        key_for_json, key_for_raw)
from warmroute.core.decision import TOKENIZE_FAILED
from warmroute.core.disaggregation import DECODE, NOT_SPLITTABLE, PREFILL, Plan, decode_after, plan_for_decode, pool_of
from warmroute.core.stages import Handles
from warmroute.core.stages.routable import routable
from warmroute.core.strategies import APPROXIMATE, Decision, NoInstanceAvailable, make_strategy, settings_for
from warmroute.router.autoscaling import FleetSignals
from warmroute.router.errors import ApiError, bad_request, no_instance
from warmroute.router.metrics import Metrics
from warmroute.router.prompt_tokens import OFFLOAD_CHARS, TEMPLATE_PLACES, PromptTokenizer, Untokenizable
from warmroute.router.settings import RouterSettings
from warmroute.router.shared_index import IndexUpdates
from warmroute.router.usage import EngineUsage

log = logging.getLogger("warmroute.router")

SESSION_HEADER = "x-session-id"
_NO_KEY = key_for_raw(b"")  # for paths that carry no prompt: only load matters
QUEUE_POLL = 0.25  # seconds: while requests wait, the queue is pumped at least this often (one timer, not one each)
TOKENIZED_ROUTES = CHAT_ROUTES | PROMPT_ROUTES  # what precise mode tokenizes (the others: approximate model only)
# msgspec rather than json because the parse runs in the event loop (a thread would not help: neither parser lets
# go of the GIL), and msgspec's is the shorter stall (docs/tuning.md).
_decode = msgspec.json.Decoder().decode
OFF_LOOP_BYTES = 1 << 20  # bodies from this size get their key built in a thread (key_off_loop)


def _too_busy(message: str, retry_after_s: float) -> ApiError:
    return ApiError(429, message, "rate_limit_error", headers={"Retry-After": str(max(1, round(retry_after_s)))})


def is_routed(path: str) -> bool:
    return path in ROUTED_PATHS


def _noted(key: RoutingKey, decision: Decision) -> Decision:
    """A request precise mode could not tokenize says so (x-warmroute-reason: ...; match=approximate;
    tokenize_failed)."""
    if key.untokenized is not None:
        decision.match, decision.note = APPROXIMATE, TOKENIZE_FAILED
    return decision


class Router:
    def __init__(self, settings: RouterSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.fleet = Fleet(FleetSettings(block_bytes=settings.block_bytes,
                                         index_max_bytes=settings.index_memory_bytes,
                                         default_kv_capacity_tokens=settings.kv_capacity_tokens,
                                         feedback=settings.engine_feedback))
        for b in settings.backends:
            self.fleet.add(b.name, b.kv_capacity_tokens, engine_capacity=settings.engine_capacity_of(b), role=b.role)
        wait = (lambda i: self.admission.slot_wait(i)) if settings.admission.enabled else None  # (the queue is built below)
        self.strategy = make_strategy(settings.strategy, settings.strategy_settings(), handles=Handles(slot_wait=wait),
                                      profiles=settings.strategies)
        self._any = make_strategy("least_loaded")
        self.admission = Admission(admission_settings(  # a strategy defined in the config may set its own hold_*
            settings_for(settings.strategy, settings, settings.strategies),
            record_queued=self.strategy.records_prefixes), self.fleet)
        self.exact: ExactIndex | None = None  # precise mode (kv_events): what the engines report holding
        self.tokenizer: PromptTokenizer | None = None
        self.lora_adapters: set[str] = set()  # model names that are LoRA adapters (models.py ModelCatalog)
        if settings.kv_events:
            self.tokenizer = PromptTokenizer(settings.tokenizer, chat_template=settings.chat_template)  # it loads
            if not self.tokenizer.templates:
                log.warning("precise mode: no chat template found (%s): chat requests are routed on the approximate "
                            "model", TEMPLATE_PLACES)
            self._untokenizable: set[str] = set()  # causes logged once already
            self.exact = ExactIndex(settings.index_memory_bytes // BYTES_PER_BLOCK, settings.kv_speculative_ttl)
            self.strategy.exact = self.exact
        self.shared: IndexUpdates | None = None  # other replicas / workers hear what this one records
        self._pump_timer: asyncio.TimerHandle | None = None  # while requests wait (`_keep_pumping`)
        # What autoscalers read: demand per model, and what each instance's cache is worth.
        self.signals = FleetSignals(self.fleet, self.admission, settings, settings.concurrency_threshold)
        self._hooks = _Books(self)
        # Legs others wait for while they compute a prefix those others share (`hold_for_prefill`), each with the
        # event its first token or end sets.
        self._prefill_waits: dict[Leg, asyncio.Event] = {}

    # -- deciding ------------------------------------------------------------------------------------------
    def key_of(self, path: str, body: bytes, session: str | None, parsed: Any = None) -> RoutingKey:
        """The routing key of a routed path's body (`parsed`: the body already parsed, by tokenize_ahead); a body
        the route cannot read raises a 400."""
        if path in RAW_ROUTES:
            return key_for_raw(body, session)
        if not body:
            raise bad_request("request body is empty; expected a JSON object")
        try:
            if parsed is None:
                parsed = _decode(body)  # the body is parsed once, here, and forwarded as the original bytes
        except RecursionError:
            raise bad_request("request body is not valid JSON: nested too deeply") from None
        except (msgspec.DecodeError, ValueError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
        try:
            key = key_for_json(path, parsed, session)
        except KeyError_ as exc:
            raise bad_request(str(exc)) from None
        except (RecursionError, TypeError, ValueError, OverflowError):
            raise bad_request("request body cannot be read as a request for " + path) from None
        if self.tokenizer is not None and path in TOKENIZED_ROUTES:
            self._tokenize(key, path, parsed)
        return key

    def _tokenize(self, key: RoutingKey, path: str, parsed: dict) -> None:
        """Precise mode: the request's token ids on the key. Where the router cannot make them, the request is
        routed on the approximate model (the engine may well serve it: the router must not refuse it)."""
        try:
            key.token_data = self.tokenizer.tokens_for(path in CHAT_ROUTES, parsed)
        except Exception as exc:  # fail open, whatever the template or the tokenizer raise
            cause = exc.cause if isinstance(exc, Untokenizable) else "tokenizer_error"
            key.token_data, key.untokenized = None, cause
            self.metrics.untokenized(cause)
            if cause not in self._untokenizable:
                self._untokenizable.add(cause)
                log.warning("precise mode: a request could not be tokenized (%s: %s); routing such requests on the "
                            "approximate model (logged once per cause)", cause, str(exc) or type(exc).__name__)
            return
        salt = parsed.get("cache_salt")
        lora = key.model if key.model in self.lora_adapters else None  # vLLM: an adapter by its name
        key.token_seed = token_seed(lora, salt if isinstance(salt, str) else None)

    def decide(self, key: RoutingKey | None, avoid: str | None = None, within: set[str] | None = None) -> Decision:
        """The strategy's choice for this key (least loaded when there is no key); NoInstanceAvailable if none.
        `avoid` names an instance that just failed this request: it is left out of this one choice; `within`, where
        given, the instances it may choose from (a gateway's subset hint)."""
        model = key.model if key else None
        if self.fleet.disaggregated:  # a whole request goes to a decode instance (prefill-only ones take prefill legs)
            pool = pool_of(self.fleet, DECODE, model, but=avoid)
        else:
            pool = routable(self.fleet, model, but=avoid) if avoid is not None or within is not None else None
        if within is not None:
            pool = [i for i in pool if i.name in within]
        if key is None:
            return self._any.choose(_NO_KEY, self.fleet, pool)
        self.fleet.now = now = time.monotonic()  # the core reads no clock (slow start's ramps)
        if self.exact is not None:
            self.exact.now = now
        return _noted(key, self.strategy.choose(key, self.fleet, pool))

    async def key_off_loop(self, path: str, body: bytes, session: str | None) -> RoutingKey | None:
        """The key of a large body, built in a thread: rendering a long conversation is Python that lets the
        event loop run every few ms there (the parse itself does not); None for a small one or an unrouted path."""
        if len(body) < OFF_LOOP_BYTES or not is_routed(path):
            return None
        return await asyncio.to_thread(self.key_of, path, body, session)

    async def tokenize_ahead(self, path: str, body: bytes) -> Any:
        """Precise mode: tokenize, off the event loop, a request's text the tokenizer has not seen (a long new
        document takes tens of milliseconds, which would stall every other request); returns the parsed body for
        `route` (None where there is nothing worth it, or the body is not JSON: `route` then says why)."""
        if self.tokenizer is None or path not in TOKENIZED_ROUTES or len(body) < OFFLOAD_CHARS:
            return None
        try:
            parsed = _decode(body)
        except (msgspec.DecodeError, ValueError, RecursionError):
            return None
        if isinstance(parsed, dict):
            await self.tokenizer.warm(path in CHAT_ROUTES, parsed)
        return parsed

    def route(self, path: str, body: bytes, session: str | None, key: RoutingKey | None = None,
              parsed: Any = None, within: set[str] | None = None) -> tuple[RoutingKey | None, Decision]:
        """Key (unless given: key_off_loop; `parsed`: the body, parsed by tokenize_ahead) + decision for one
        request (among `within`, where given), timed and counted."""
        start = time.perf_counter()
        if key is None and is_routed(path):
            key = self.key_of(path, body, session, parsed)
        decision = self.decide(key, within=within)
        self.metrics.decided(decision.reason, decision.matched_ratio, time.perf_counter() - start)
        return key, decision

    # -- disaggregated serving (core/disaggregation.py) ----------------------------------------------------------
    def split(self, path: str, key: RoutingKey | None, decision: Decision) -> Plan:
        """In a disaggregated fleet: whether a request whose decode instance is `decision`'s is split, and where its
        prefill leg goes. Only the OpenAI routes can carry the engines' transfer parameters."""
        if key is None or path not in TOKENIZED_ROUTES:
            plan = Plan(decision, None, NOT_SPLITTABLE)
        else:
            plan = plan_for_decode(self.strategy, key, self.fleet, self.settings, decision)
        self.metrics.pd_decided(plan.why)
        return plan

    def prefill_instead(self, key: RoutingKey, failed: str, decode: str) -> Decision:
        """Another prefill instance for a request whose prefill leg failed at `failed`."""
        pool = [i for i in pool_of(self.fleet, PREFILL, key.model, but=decode) if i.name != failed]
        return self.strategy.choose(key, self.fleet, pool)

    def replan(self, plan: Plan, first: Decision) -> Plan:
        """The plan once admission gave its first leg `first` (the same decision, or another instance's after a
        wait)."""
        return Plan(plan.decode, first, plan.why) if plan.split else Plan(first, None, plan.why)

    def decode_after(self, key: RoutingKey, prefill: str) -> Decision:
        """The decode instance for a split request whose prefill leg `prefill` has just answered: chosen now, on
        the load it finds (the simulator does the same)."""
        self.fleet.now = time.monotonic()
        return decode_after(self.strategy, key, self.fleet, prefill)

    # -- admission (core/admission/) ------------------------------------------------------------------------
    def open(self) -> Lifecycle:
        """A new request's lifecycle (core/lifecycle.py), its books kept in this router's fleet and queue."""
        return Lifecycle(self.fleet, self.admission, time.perf_counter, records_prefixes=self.strategy.records_prefixes,
                         hooks=self._hooks)

    async def admit(self, life: Lifecycle, decision: Decision, size_bytes: int = 0,
                    queue: bool = True, pool: str = "") -> tuple[Decision, float]:
        """Send `decision` now if its instance has room (or `queue` is off); else wait in the router's queue until an
        instance takes this request (then decided again for that instance): the queue is pumped whenever a request
        finishes and, while anything waits, every QUEUE_POLL seconds by one timer (deadlines, other workers' requests
        that finish unseen, engines whose capacity grew). Returns the decision to
        send and the seconds waited (0.0: it did not wait). Raises 429 (queue full, preempted, deadline) or
        503 (no healthy instance left). A client that leaves takes its request out of the queue at once. A request
        without a key (/tokenize, /score, ...) counts as any other against its instance's room and its tenant's
        share; it has no prefix to keep, so it goes to the least loaded instance with room."""
        adm = self.admission
        loop = asyncio.get_running_loop()
        try:
            refused = life.admit(decision, loop.time(), size_bytes, queue and adm.settings.enabled, pool)
        except QueueFull as exc:
            self.metrics.left_queue(life.priority, life.tenant, 0.0, QUEUE_FULL)
            raise _too_busy(str(exc), 1.0) from None
        waiter = life.waiter
        if waiter is None:
            if queue and adm.settings.enabled:
                self.metrics.admitted(IMMEDIATE)
            return decision, 0.0
        life.shell = loop.create_future()  # set when it leaves the queue (`_left`)
        self.metrics.queue_changed(life.priority, life.tenant, +1, adm.bytes)
        for w in refused:
            self._left(w)
        self.pump()
        self._keep_pumping(loop)
        try:
            await life.shell
        except BaseException:  # the client left (cancelled): out of the queue, or its reserved slot back
            queued = waiter.seq in adm.waiters
            life.cancel()
            if queued:
                self._left(waiter, "client_closed")
            else:
                self.pump()
            raise
        if waiter.shed is not None:
            life.shed()
            raise self._refusal(waiter, life.key)
        return self._decide_assigned(life), loop.time() - waiter.enqueued

    def _decide_assigned(self, life: Lifecycle) -> Decision:
        """The decision for the instance the queue gave a waiter (its reserved slot becomes a request in flight
        now: the caller dispatches it without awaiting); if that instance went down meanwhile, a fresh one."""
        waiter, key = life.waiter, life.key
        assert waiter is not None and waiter.instance is not None
        name = waiter.instance
        life.assigned()
        self.metrics.admitted(waiter.why)
        try:
            self.fleet.now = time.monotonic()
            if key is None:
                decision = decide_at(self._any, _NO_KEY, self.fleet, name, waiter.first)
            else:
                decision = _noted(key, decide_at(self.strategy, key, self.fleet, name, waiter.first))
        except NoInstanceAvailable:
            decision = self.decide(key)
        decision.waited_for = waiter.why
        return decision

    def _keep_pumping(self, loop: asyncio.AbstractEventLoop) -> None:
        """One timer for the whole queue: a pump every QUEUE_POLL seconds while anything waits."""
        if self._pump_timer is None and self.admission.waiters:
            self._pump_timer = loop.call_later(QUEUE_POLL, self._timed_pump, loop)

    def _timed_pump(self, loop: asyncio.AbstractEventLoop) -> None:
        self._pump_timer = None
        self.pump()
        self._keep_pumping(loop)

    def pump(self) -> None:
        """Instances with room take waiting requests; those past their deadline are refused. Wakes each."""
        adm = self.admission
        if not adm.waiters:
            return
        assigned, shed = adm.pump(asyncio.get_running_loop().time())
        for w in assigned + shed:
            self._left(w)

    def _left(self, w: Waiter, shed: str | None = None) -> None:
        """A waiter left the queue (assigned, refused or gone): its metrics, and its task woken."""
        loop = asyncio.get_running_loop()
        self.metrics.queue_changed(w.priority, w.tenant, -1, self.admission.bytes)
        self.metrics.left_queue(w.priority, w.tenant, loop.time() - w.enqueued, shed or w.shed)
        future = w.payload.shell if isinstance(w.payload, Lifecycle) else None
        if isinstance(future, asyncio.Future) and not future.done():
            future.set_result(None)

    def _refusal(self, w: Waiter, key: RoutingKey | None) -> ApiError:
        if w.shed == NO_INSTANCE:
            return no_instance(self.settings.health_interval, key.model if key else None)
        why = {DEADLINE: f"waited admission.timeout_s ({self.settings.admission.timeout_s:g} s) without room at an "
                         "instance",
               PREEMPTED: "the router's queue is full and a higher-priority request took this one's place"}
        return _too_busy(f"the fleet is overloaded: {why.get(w.shed or '', w.shed)}; retry later",
                         max(1.0, self.fleet.mean_ttft_s))

    # -- the books -----------------------------------------------------------------------------------------
    def dispatch(self, life: Lifecycle, decision: Decision, defer_record: bool = False, role: str = "",
                 alongside: bool = False) -> Leg:
        """The request is being sent: its books now; its chain into the index now, or (`defer_record`, from a
        running event loop) on the loop's next turn, once the request is on its way to the instance: a long
        prompt's chain is thousands of blocks, time the request need not wait (docs/tuning.md). A request routed in
        between does not see it yet, as if it had arrived a moment earlier. In precise mode its token blocks are
        speculatively held there until the engine's events arrive."""
        key = life.key
        if self.exact is not None and key is not None and key.token_data:
            blocks = self.exact.instances.get(decision.instance)
            if blocks is not None and blocks.block_size:
                self.exact.speculate(decision.instance, key.token_blocks(blocks.block_size), time.monotonic())
        # A streamed answer's first chunk marks the end of its prefill (a prefill leg's answer is one token)
        leads = role == PREFILL or (key is not None and key.streams)
        leg = life.dispatch(decision, record=not defer_record, role=role, alongside=alongside, leads=leads)
        if defer_record and leg.blocks:
            asyncio.get_running_loop().call_soon(life.record, leg)
        return leg

    async def hold_for_prefill(self, life: Lifecycle, leg: Leg) -> float:
        """Hold `leg`, sent but not yet on its way, while another request at its instance is still computing the
        prefix it is predicted to find there (core/prefills.py), for at most shared_prefill_wait_s: until that one's
        first token or end. Returns the seconds held (0.0: it was not)."""
        adm = self.admission.settings
        if not adm.enabled or adm.shared_prefill_wait_s <= 0:
            return 0.0
        leader = life.prefill_leader(leg)
        if leader is None:
            return 0.0
        done = self._prefill_waits.get(leader)
        if done is None:
            done = self._prefill_waits[leader] = asyncio.Event()
        try:
            async with asyncio.timeout(adm.shared_prefill_wait_s):
                await done.wait()
            outcome = "computed"
        except TimeoutError:
            outcome = "timeout"
        life.resumed(leg)
        self.metrics.shared_prefill_wait(outcome, leg.held_s)
        return leg.held_s

    def _prefill_over(self, leg: Leg) -> None:
        """`leg`'s first token or end: whoever waits for its prefill goes."""
        done = self._prefill_waits.pop(leg, None)
        if done is not None:
            done.set()

    def engine_usage(self, life: Lifecycle, usage: EngineUsage) -> None:
        """The engine said how much of this request's prompt it had cached: count it, correct the index."""
        leg = life.leg
        assert leg is not None
        decision, name = leg.decision, leg.instance
        # A decode leg's engine reports its prefill leg's cached tokens (vLLM forwards them), not its own cache's:
        # the prefill leg counted them already.
        if name not in self.fleet.instances or leg.role == DECODE:
            return
        verdict = life.feedback(usage.cached_tokens, usage.prompt_tokens, decision.prompt_tokens)
        prompt = usage.prompt_tokens or decision.prompt_tokens
        predicted = decision.matched_tokens * prompt / decision.prompt_tokens if decision.prompt_tokens else 0.0
        self.metrics.engine_usage(name, prompt, usage.cached_tokens, predicted,
                                  verdict.kind if verdict is not None else None, decision.match or APPROXIMATE)

    def unrecord(self, decision: Decision) -> None:
        """The request never reached the instance: it does not hold the blocks after all."""
        if decision.blocks and self.strategy.records_prefixes:
            self.fleet.index.forget(decision.instance, decision.blocks)
            if self.shared is not None:
                self.shared.forgotten(decision.instance, decision.blocks)


class _Books(Hooks):
    """The router's side effects of a request's steps (core/lifecycle.py keeps the books themselves)."""

    __slots__ = ("router",)

    def __init__(self, router: Router) -> None:
        self.router = router

    def dispatched(self, life: Lifecycle, leg: Leg) -> None:
        router = self.router
        inst = router.fleet.instances.get(leg.instance)
        if inst is not None:
            router.signals.dispatched(inst, leg.uncached_tokens)
        self._publish_inflight(leg.instance)

    def recorded(self, life: Lifecycle, leg: Leg) -> None:
        """The chain is (about to be) cached on the instance: to the other replicas too."""
        router = self.router
        assert leg.blocks is not None
        router.signals.requested(leg.blocks)
        if router.shared is not None:
            router.shared.recorded(leg.instance, leg.blocks)

    def first_token(self, life: Lifecycle, leg: Leg, seconds: float) -> None:
        router = self.router
        router._prefill_over(leg)
        router.signals.first_token(leg.instance, leg.prefill_ahead, seconds)
        router.metrics.first_byte(leg.instance, seconds)
        adm = router.admission
        if adm.caps_queues and adm.waiters:  # a shorter engine queue: a capped tenant may go
            router.pump()

    def finished(self, life: Lifecycle, leg: Leg, seconds: float) -> None:
        router = self.router
        router._prefill_over(leg)
        router.pump()  # room was made: a waiting request may go
        if leg.got_first and leg.blocks and router.shared is not None:
            # The refresh at finish (core/fleet.py) too: otherwise the other replicas / workers age this chain
            # from when it was sent, and a long answer's history can drop out of their models before its turn.
            router.shared.recorded(leg.instance, leg.blocks)
        self._publish_inflight(leg.instance)

    def _publish_inflight(self, name: str) -> None:
        inst = self.router.fleet.instances.get(name)
        if inst is not None:
            self.router.metrics.set_inflight(name, inst.inflight, inst.inflight_prompt_tokens)
