"""Precise mode's I/O: one ZMQ subscriber per instance, feeding its KV-cache events to the exact index.

Each subscriber connects a SUB socket to the instance's event endpoint and follows the sequence numbers:
  - the next number: the batch is applied;
  - a jump ahead (a lost batch): the missing ones are asked from the instance's replay endpoint; where there is
    none, or it no longer holds them, the instance is marked *stale*: the strategy uses the approximate model for
    it until it is in step again (its cache is cleared, it restarts, or a later replay from its first batch works);
  - a number going back, or a replay that no longer holds the last batch received as it was received (asked after
    a quiet spell too): the engine restarted; what it reported before is forgotten;
  - AllBlocksCleared: its index is emptied (the engine said so: still in step);
  - a message that cannot be read: counted and skipped.
A subscriber that starts after its instance (a replica started late) asks for a replay from batch 0 (from the
oldest batch the engine still buffers, where it no longer holds batch 0) and is stale until it gets one. A replay
is read as it arrives (a time limit between its messages, not on the whole: vLLM buffers 10,000 batches) and
applied batch by batch, letting the event loop run; live messages wait on the socket meanwhile and those the
replay delivered are recognised by their sequence number and timestamp. A subscriber that fails (an endpoint ZMQ
refuses, an unreadable answer from the instance) logs it once per cause, counts it and starts again after a
growing delay. Everything it does is counted (KvEventMetrics) and logged once per change of state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from prometheus_client import CollectorRegistry, Counter, Gauge

from warmroute.core.exact_index import ExactIndex
from warmroute.core.kv_events import (AllBlocksCleared, BadMessage, EventBatch, EventSource, decode_batch, decode_seq,
                                     encode_seq, replay_frames, source_from_vllm)
from warmroute.router.background import cancel_all
from warmroute.router.connections import Upstreams
from warmroute.router.members import Member
from warmroute.router.settings import Backend, RouterSettings

log = logging.getLogger("warmroute.router")

REPLAY_GAP_S = 2.0  # a replay that sends nothing for this long (between two of its messages) has failed
DISCOVERY_TIMEOUT_S = 2.0  # for an instance's answer to GET /kv_event_sources
START_WAIT_S = 5.0  # the router's start waits this long, at most, for its subscribers' first catch-up
YIELD_S = 0.005  # a replay applied in one go lets the event loop run at least this often
RETRY_S, RETRY_MAX_S = 0.5, 30.0  # a failed subscriber starts again after this, doubling up to the most
RCV_HWM = 100_000  # messages ZMQ may queue on our side (vLLM's publisher allows as many): none dropped in a catch-up
MAX_CAUSES = 64  # distinct failure causes logged per instance (each once)
IDLE_CHECK_S = 5.0  # with nothing heard for this long, the replay socket is asked whether we are still in step
SEEN_BATCHES = 4096  # batches remembered to tell a replayed batch's duplicate from a restarted engine's
SOURCES_PATH = "/kv_event_sources"  # vLLM's own answer to "where do you publish?"
# A discovery answer: (HTTP status, JSON body); raises OSError, aiohttp.ClientError or TimeoutError when unanswered.
Discover = Callable[[], Awaitable[tuple[int, Any]]]
_STALE, _FRESH = "stale", "fresh"
_FAILED, _REFUSED, _HOLE, _UNREADABLE = "failed", "refused", "hole", "unreadable"  # why a replayed run stopped


class ConnectFailed(OSError):
    """ZMQ refused an endpoint (malformed, or its host cannot be resolved)."""


class KvEventMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = r = registry
        self.received = Counter("warmroute_kv_events_received", "KV-event batches received per instance "
                                "(live and replayed)", ["backend"], registry=r)
        self.applied = Counter("warmroute_kv_events_applied", "KV events that changed the exact index",
                               ["backend"], registry=r)
        self.bad = Counter("warmroute_kv_events_bad", "KV-event messages or events skipped as unreadable or "
                           "unknown", ["backend"], registry=r)
        self.gaps = Counter("warmroute_kv_events_gaps", "Sequence gaps (lost batches) and restarts, by kind "
                            "(gap, restart)", ["backend", "kind"], registry=r)
        self.replays = Counter("warmroute_kv_events_replays", "Replay requests by outcome (ok, failed)",
                               ["backend", "outcome"], registry=r)
        self.stale = Gauge("warmroute_kv_events_stale", "1 while an instance's exact index is out of step "
                           "with its engine (the approximate model routes for it)", ["backend"], registry=r,
                           multiprocess_mode="livemax")
        self.blocks = Gauge("warmroute_kv_index_blocks", "Blocks each instance reported holding (exact index)",
                            ["backend"], registry=r, multiprocess_mode="livemostrecent")
        self.failures = Counter("warmroute_kv_events_failures", "Subscriber failures by kind (discovery: an "
                                "unusable /kv_event_sources answer; connect: an endpoint ZMQ refuses; error: "
                                "anything else), each followed by a retry", ["backend", "kind"], registry=r)
        self.lag = Gauge("warmroute_kv_events_lag_seconds", "Seconds from the engine's timestamp of the latest "
                         "batch to its arrival (engine and router clocks)", ["backend"], registry=r,
                         multiprocess_mode="livemostrecent")


@dataclass
class Stream:
    """What a subscriber knows of one instance's sequence."""

    name: str
    last_seq: int | None = None  # the latest batch applied (live or replayed)
    # seq -> engine timestamp of the latest batches applied: a live batch under a number seen before is a
    # duplicate of a replayed one if its timestamp is the same, else the engine restarted
    seen: OrderedDict[int, float] = field(default_factory=OrderedDict)
    state: str = _STALE  # fresh once in step with the engine
    batches: int = 0  # applied
    live: int = 0  # received on the live stream


class KvEventSubscriber:
    def __init__(self, name: str, endpoint: str | None, index: ExactIndex, metrics: KvEventMetrics,
                 replay_endpoint: str | None = None, topic: str = "", idle_s: float = IDLE_CHECK_S,
                 discover: Discover | None = None, host: str = "") -> None:
        """`discover`: ask the instance (at `host`) where it publishes first; `endpoint` and `replay_endpoint` are
        then what to use where it cannot say (an engine without GET /kv_event_sources)."""
        import zmq.asyncio  # imported here: precise mode is optional (the `events` extra)

        self.name, self.endpoint, self.replay_endpoint = name, endpoint, replay_endpoint
        self.discover, self.host = discover, host
        self.configured: tuple[str | None, str | None, str | None] = (endpoint, replay_endpoint, None)
        self.topic = topic.encode()
        self.index, self.metrics = index, metrics
        self.idle_s = idle_s
        self.stream = Stream(name)
        self._ctx = zmq.asyncio.Context.instance()
        self._task: asyncio.Task | None = None
        self.ready = asyncio.Event()  # set once it has tried to catch up with what was published before it came
        self._next_retry = 0.0
        self._causes: set[str] = set()  # failures logged already
        index.add_instance(name)
        metrics.stale.labels(name).set(1)

    @property
    def fresh(self) -> bool:
        return self.stream.state == _FRESH

    async def start(self) -> None:
        self.launch()

    def launch(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"warmroute-kv-events-{self.name}")

    def cancel(self) -> asyncio.Task | None:
        """Stop following the instance (its socket closes as the task ends) and forget what it reported."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        self.index.remove_instance(self.name)
        for gauge in (self.metrics.stale, self.metrics.blocks, self.metrics.lag):
            with contextlib.suppress(KeyError):
                gauge.remove(self.name)
        return task

    async def stop(self) -> None:
        await cancel_all([self.cancel()])

    async def _run(self) -> None:
        """Follow the instance; whatever fails, say so (once per cause), count it, and start again later."""
        delay = RETRY_S
        while True:
            started = time.monotonic()
            try:
                await self._follow()
                return  # it publishes nowhere we can follow
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # anything: a subscriber must never end silently
                kind = ("discovery" if isinstance(exc, BadMessage) else
                        "connect" if isinstance(exc, ConnectFailed) else "error")
                self.metrics.failures.labels(self.name, kind).inc()
                self._set_state(_STALE, f"subscriber failed ({kind})")
                self.ready.set()
                if time.monotonic() - started > RETRY_MAX_S:
                    delay = RETRY_S  # it had been working: this is a new failure, not the same one again
                cause = f"{kind}: {exc}" if str(exc) else f"{kind}: {type(exc).__name__}"
                if cause not in self._causes and len(self._causes) < MAX_CAUSES:
                    self._causes.add(cause)
                    log.warning("kv events %s: %s; trying again in %.1f s (logged once)", self.name, cause, delay,
                                exc_info=kind == "error")
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)

    async def _follow(self) -> None:
        import zmq

        if self.discover is not None:
            await self._locate()
        if self.endpoint is None:
            self.ready.set()  # it publishes nowhere we can follow: the approximate model routes for it
            return
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)  # live batches wait here while a replay is applied
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        try:
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                raise ConnectFailed(f"cannot connect to {self.endpoint!r}: {exc}") from None
            if self.replay_endpoint is not None:  # what it published before we came (nothing: in step already)
                await self._resync("subscribed")
            self.ready.set()
            while True:
                try:  # not wait_for: on Python 3.11 it drops a cancel that meets a finished receive
                    async with asyncio.timeout(self.idle_s):
                        frames = await sock.recv_multipart()
                except TimeoutError:
                    await self._idle_check()
                    continue
                await self.receive(frames)
        finally:
            sock.close(linger=0)

    async def _locate(self) -> None:
        """Ask the instance where it publishes until it answers (it may still be starting); an engine that has no
        such endpoint keeps the configured ones."""
        delay = 0.25
        while True:
            try:
                status, body = await self.discover()
            except (OSError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                status, body = 0, str(exc) or type(exc).__name__
            if status == 200:
                try:
                    source, note = source_from_vllm(body, self.host)
                except BadMessage as exc:
                    raise BadMessage(f"its {SOURCES_PATH} answer cannot be used: {exc}") from None
                self._use(source, note)
                return
            if status in (404, 405):
                return
            log.debug("kv events %s: %s not answered (%s); asking again in %.1f s", self.name, SOURCES_PATH,
                      status or body, delay)
            await asyncio.sleep(delay)
            delay = min(self.idle_s, delay * 2)

    def _use(self, source: EventSource | None, note: str) -> None:
        if source is None:
            log.info("kv events %s: not following its events: %s", self.name, note)
            self.endpoint = self.replay_endpoint = None
            return
        self.endpoint, self.replay_endpoint = source.endpoint, source.replay_endpoint
        log.info("kv events %s: it publishes at %s (replay: %s)%s", self.name, source.endpoint,
                 source.replay_endpoint or "none", f"; {note}" if note else "")

    # -- one message ----------------------------------------------------------------------------------------
    async def receive(self, frames: list[bytes]) -> None:
        """One live message: decoded, put in sequence, applied (or the gap filled first)."""
        decoded = self._decode(frames)
        if decoded is None:
            return
        seq, batch = decoded
        if batch is None:
            return  # unreadable: the batch after it shows the gap, and replay is asked for it
        s = self.stream
        s.live += 1
        if s.last_seq is not None and seq <= s.last_seq:
            if s.seen.get(seq) == batch.ts:
                return  # a replay delivered it already
            # A number already used, for another batch: a new engine process counting from 0 again.
            self._restarted(f"sequence went back from {s.last_seq} to {seq}")
        if s.last_seq is None and seq != 0:  # joined mid-stream (or restarted and missed its first batches)
            await self._resync(f"joined at sequence {seq}")
        elif s.last_seq is not None and seq > s.last_seq + 1:
            self.metrics.gaps.labels(self.name, "gap").inc()
            await self._fill_gap(s.last_seq + 1, seq)
        elif s.last_seq is None:
            self._set_state(_FRESH, "first batch")
        if s.last_seq is None or seq > s.last_seq:
            self._apply(seq, batch)
        await self._retry_if_stale()

    def _decode(self, frames: list[bytes]) -> tuple[int, EventBatch | None] | None:
        """(sequence number, batch); the batch None where only the payload cannot be read (a batch lost: it
        takes its number); None where not even the number can."""
        self.metrics.received.labels(self.name).inc()
        seq = None
        try:
            if len(frames) != 3:
                raise BadMessage(f"{len(frames)} frames, expected 3 (topic, sequence, payload)")
            seq = decode_seq(frames[1])
            batch = decode_batch(frames[2])
        except BadMessage as exc:
            self.metrics.bad.labels(self.name).inc()
            log.warning("kv events %s: message skipped: %s", self.name, exc)
            return None if seq is None else (seq, None)
        if batch.skipped:
            self.metrics.bad.labels(self.name).inc(batch.skipped)
        return seq, batch

    def _apply(self, seq: int, batch: EventBatch) -> None:
        s = self.stream
        s.last_seq = seq
        s.batches += 1
        s.seen[seq] = batch.ts
        if len(s.seen) > SEEN_BATCHES:
            s.seen.popitem(last=False)
        applied = self.index.apply(self.name, batch.events)
        self.metrics.applied.labels(self.name).inc(applied)
        self.metrics.blocks.labels(self.name).set(self.index.size(self.name))
        if batch.ts > 0:
            self.metrics.lag.labels(self.name).set(max(0.0, time.time() - batch.ts))
        if any(isinstance(e, AllBlocksCleared) for e in batch.events) and not self.fresh:
            self._set_state(_FRESH, "the engine cleared its cache")

    # -- getting back in step -------------------------------------------------------------------------------
    def _restarted(self, why: str) -> None:
        self.metrics.gaps.labels(self.name, "restart").inc()
        log.warning("kv events %s: %s: the engine restarted; index cleared", self.name, why)
        self.index.clear(self.name)
        self.stream.last_seq = None
        self.stream.seen.clear()

    async def _fill_gap(self, start: int, upto: int) -> None:
        """Batches start..upto-1 were lost: replay them, or mark the instance stale. The replay starts at the last
        batch applied, to check it is still the engine's (one that restarted unheard reuses the numbers)."""
        restarted = False

        def check(seq: int, batch: EventBatch | None) -> bool:
            nonlocal restarted
            restarted = batch is not None and seq == start - 1 and self.stream.seen.get(seq, batch.ts) != batch.ts
            return not restarted and seq <= start  # else it no longer holds the first batch lost

        if await self._replay_run(start - 1, check) != _FAILED:
            if restarted:
                self._restarted(f"batch {start - 1} is not the one received under that number")
                await self._resync("restarted")
                return
            if self.stream.last_seq is not None and self.stream.last_seq >= upto - 1:
                return
        self._set_state(_STALE, f"batches {start}..{upto - 1} lost" +
                        ("" if self.replay_endpoint else " (no replay endpoint)"))

    async def _resync(self, why: str) -> None:
        """Rebuild the instance's index from what its engine still buffers (batch 0 on, or its oldest where it no
        longer holds batch 0), through replay; stale if that cannot be done."""
        if self.replay_endpoint is None:
            self._set_state(_STALE, f"{why} (no replay endpoint)")
            return
        if self.fresh:
            self._set_state(_STALE, f"{why}; catching up by replay")
        s, first = self.stream, None

        def check(seq: int, batch: EventBatch | None) -> bool:
            nonlocal first
            first = seq
            self.index.clear(self.name)  # rebuilt from here, batch by batch
            s.last_seq = None
            s.seen.clear()
            return True

        stop = await self._replay_run(0, check)
        if stop == _FAILED:
            self._set_state(_STALE, f"{why}; replay failed")
        elif first is None:  # it has published nothing yet (a new process): in step from its first batch
            if s.last_seq is not None:
                self._restarted("its replay buffer is empty")
            self._set_state(_FRESH, f"{why}; nothing published yet")
        elif stop is not None:
            missing = 0 if s.last_seq is None else s.last_seq + 1
            self._set_state(_STALE, f"{why}; batch {missing} " +
                            ("cannot be read" if stop == _UNREADABLE else "is no longer buffered"))
        else:
            note = "" if first == 0 else (f"; batches before {first} are no longer buffered: blocks stored only then "
                                          "are unknown until the engine reports them again")
            self._set_state(_FRESH, f"{why}; replayed batches {first}..{s.last_seq}{note}")

    async def _retry_if_stale(self) -> None:
        if self.fresh or self.replay_endpoint is None or time.monotonic() < self._next_retry:
            return
        self._next_retry = time.monotonic() + self.idle_s
        await self._resync("stale")

    async def _idle_check(self) -> None:
        """Nothing heard for idle_s: ask the replay socket for our last batch, to find an engine that restarted
        and has published nothing since (its predecessor's blocks would otherwise stay here) and batches lost
        without a later one to show the gap."""
        last = self.stream.last_seq
        if not self.fresh or last is None or self.replay_endpoint is None:
            await self._retry_if_stale()
            return
        same = False

        def check(seq: int, batch: EventBatch | None) -> bool:
            nonlocal same
            same = batch is not None and seq == last and self.stream.seen.get(last, batch.ts) == batch.ts
            return same

        if await self._replay_run(last, check) == _FAILED:
            return  # the engine is not answering (down, or restarting): nothing to conclude yet
        if not same:  # (an empty replay too)
            self._restarted(f"its replay no longer holds batch {last} as received")
            await self._resync("restarted")

    async def _replay_run(self, start: int, check: Callable[[int, EventBatch | None], bool]) -> str | None:
        """Replay from `start`, `check` looking at the first batch (False: stop there), then applying each batch
        that follows on from the last applied, as it arrives. Where batches are missing from the replay (a ROUTER
        socket drops what does not fit its queue: vLLM's sends its whole buffer at once), ask again from the first
        missing one, as long as each round gets further. None: applied through the end of the replay; else why
        it stopped (_FAILED: no replay; _REFUSED: by `check`; _HOLE: a batch it no longer holds; _UNREADABLE)."""
        first: Callable[[int, EventBatch | None], bool] | None = check
        while True:
            before, stop = self.stream.last_seq, None

            def take(seq: int, batch: EventBatch | None) -> bool:
                nonlocal first, stop
                if first is not None:
                    looked, first = first, None
                    if not looked(seq, batch):
                        stop = _REFUSED
                        return False
                stop = self._follows_on(seq, batch)
                return stop is None

            if await self._replay(start, take) is None:
                return _FAILED
            if stop != _HOLE or self.stream.last_seq is None or self.stream.last_seq == before:
                return stop
            start = self.stream.last_seq + 1  # the rest, again: this round got further

    def _follows_on(self, seq: int, batch: EventBatch | None) -> str | None:
        """Apply a replayed batch if it is the next one (any, where nothing is applied yet); batches applied
        already are passed over. _HOLE or _UNREADABLE where the run breaks."""
        last = self.stream.last_seq
        if last is not None and seq <= last:
            return None
        if batch is None:
            return _UNREADABLE
        if last is not None and seq != last + 1:
            return _HOLE
        self._apply(seq, batch)
        return None

    async def _replay(self, start: int, take: Callable[[int, EventBatch | None], bool]) -> int | None:
        """Ask the instance's replay socket for its batches from `start` on and give each to `take`, in order, as
        they arrive, until the replay ends or `take` says False. Returns how many it was given; None where there
        is no replay endpoint or the replay failed (nothing heard for REPLAY_GAP_S, or a socket error)."""
        if self.replay_endpoint is None:
            return None
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # unbounded: a ROUTER drops what its client cannot take in time
        given = 0
        loop = asyncio.get_running_loop()
        resumed = loop.time()
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart((b"", encode_seq(start)))
            while True:
                try:
                    async with asyncio.timeout(REPLAY_GAP_S):
                        frames = await sock.recv_multipart()
                except TimeoutError:
                    raise TimeoutError(f"nothing heard for {REPLAY_GAP_S:g} s after {given} batches") from None
                try:
                    frames = replay_frames(frames)
                except BadMessage as exc:
                    self.metrics.bad.labels(self.name).inc()
                    log.warning("kv events %s: replayed message skipped: %s", self.name, exc)
                    continue
                if frames is None:
                    break
                decoded = self._decode(frames)
                if decoded is None:
                    continue
                given += 1
                if not take(*decoded):
                    break
                if loop.time() - resumed > YIELD_S:  # a backlog arrives without a wait: let others run
                    await asyncio.sleep(0)
                    resumed = loop.time()
        except (TimeoutError, OSError, zmq.ZMQError) as exc:
            self.metrics.replays.labels(self.name, "failed").inc()
            log.warning("kv events %s: replay from %d failed: %s", self.name, start, str(exc) or type(exc).__name__)
            return None
        finally:
            sock.close(linger=0)
        self.metrics.replays.labels(self.name, "ok").inc()
        return given

    def _set_state(self, state: str, why: str) -> None:
        if self.stream.state != state:
            (log.warning if state == _STALE else log.info)("kv events %s: %s (%s)", self.name, state, why)
        self.stream.state = state
        self.metrics.stale.labels(self.name).set(1 if state == _STALE else 0)
        if state == _FRESH:
            self.index.fresh.add(self.name)
        else:
            self.index.fresh.discard(self.name)


# An instance's (publisher, replay) endpoints and the URL to ask where it publishes (kv_event_source)
Endpoints = Callable[[Backend], tuple[str | None, str | None, str | None]]


def kv_event_source(settings: RouterSettings, backend: Backend) -> tuple[str | None, str | None, str | None]:
    """An instance's KV-event publisher and replay endpoints, and the URL to ask where it publishes (None: don't
    ask): those its entry gives; else, with kv_events_discover, what the instance itself says, falling back to its
    URL's host at the ports set."""
    if backend.kv_events_endpoint is not None:
        return backend.kv_events_endpoint, backend.kv_events_replay_endpoint, None
    host = urlsplit(backend.url).hostname or ""
    host = f"[{host}]" if ":" in host else host
    pub = f"tcp://{host}:{settings.kv_events_port}" if settings.kv_events_port else None
    replay = backend.kv_events_replay_endpoint or (f"tcp://{host}:{settings.kv_events_replay_port}"
                                                   if settings.kv_events_replay_port else None)
    return pub, replay, backend.url if settings.kv_events_discover else None


class KvEventSources:
    """A component (precise mode): one subscriber per instance, following the fleet's membership (members.py:
    static, file, DNS, Kubernetes, admin API), and the exact index's bound shared out among them."""

    name = "kv-events"

    def __init__(self, index: ExactIndex, metrics: KvEventMetrics, topic: str, max_blocks: int,
                 endpoints: Endpoints, upstreams: Upstreams | None = None) -> None:
        self.index, self.metrics, self.topic = index, metrics, topic
        self.max_blocks = max_blocks  # over all instances
        self.endpoints = endpoints
        self.upstreams = upstreams  # its session asks instances where they publish
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self._running = False
        self._closing: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None  # the router's control-plane client, while it runs

    # -- membership ------------------------------------------------------------------------------------------
    def added(self, member: Member) -> None:
        self.add(member.name, *self.endpoints(member.backend))

    changed = added

    def removed(self, name: str) -> None:
        self.remove(name)

    def add(self, name: str, endpoint: str | None, replay_endpoint: str | None, url: str | None = None) -> None:
        """Follow an instance's events (again, if its endpoints changed). `url`: ask the instance at that URL where
        it publishes first (vLLM's GET /kv_event_sources), the endpoints given being the fallback; without it,
        an endpoint of None means it publishes none."""
        sub = self.subscribers.get(name)
        if sub is not None and sub.configured == (endpoint, replay_endpoint, url):
            return
        self.remove(name)
        if endpoint is None and url is None:
            return
        discover = None if url is None else self._discover_at(url)
        sub = self.subscribers[name] = KvEventSubscriber(name, endpoint, self.index, self.metrics, replay_endpoint,
                                                         self.topic, discover=discover,
                                                         host=urlsplit(url).hostname or "" if url else "")
        sub.configured = (endpoint, replay_endpoint, url)
        self._share_bound()
        log.info("kv events %s: subscribing to %s (replay: %s)", name,
                 f"what {url}{SOURCES_PATH} names" if url else endpoint, replay_endpoint or "none")
        if self._running:
            sub.launch()  # at once: a remove() right after must find its task to cancel

    def _discover_at(self, url: str) -> Discover:
        async def ask() -> tuple[int, Any]:
            if self.session is None:
                raise OSError("the router is not running")
            async with self.session.get(url.rstrip("/") + SOURCES_PATH,
                                        timeout=aiohttp.ClientTimeout(total=DISCOVERY_TIMEOUT_S)) as r:
                return r.status, (await r.json(content_type=None) if r.status == 200 else None)
        return ask

    def remove(self, name: str) -> None:
        sub = self.subscribers.pop(name, None)
        if sub is not None:
            task = sub.cancel()
            if task is not None:
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            self._share_bound()

    async def start(self) -> None:
        """Start every subscriber, and give them (together) up to START_WAIT_S to catch up with what their engines
        published before the router started, so a late replica's first decisions are already exact."""
        self.session = self.upstreams.session if self.upstreams is not None and self.upstreams.started else None
        self._running = True
        for sub in self.subscribers.values():
            await sub.start()
        waits = [sub.ready.wait() for sub in self.subscribers.values()]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(START_WAIT_S):  # not wait_for: it can drop a cancel (3.11)
                await asyncio.gather(*waits)

    async def stop(self) -> None:
        self._running = False
        for name in list(self.subscribers):
            self.remove(name)
        await cancel_all(self._closing)
        self.session = None

    def _share_bound(self) -> None:
        self.index.max_blocks = max(1, self.max_blocks // max(1, len(self.subscribers)))
