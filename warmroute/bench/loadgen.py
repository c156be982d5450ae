"""Offer a workload's load to an endpoint and collect the measured window's records.

Three ways to offer load:
  * closed loop (`concurrency`): that many sessions in flight; a driver starts the next as one ends;
  * open loop (`rate`): sessions arrive as a Poisson process (seeded), however slow the server;
  * trace time (neither, on a workload whose sessions carry `arrival_s`): at arrival_s / speedup.
In every mode a session's turns run in order, each after the previous one completed; a turn that fails (a 429,
an error) ends its session, as in the simulator: the next turn's history holds an answer that never came, so
sending it would ask the engine for a prefix no instance computed.

Requests started during the warm-up are sent but not measured. At the end of the window no new request
starts; those in flight get `drain_s` to finish, then they are cancelled and counted as "unfinished"
errors. The fleet's hit rate is the change of the engines' counters between the warm-up's end and the drain.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp

from warmroute.bench.client import send
from warmroute.bench.progress import Ticker
from warmroute.bench.scrape import CacheCounters, scrape
from warmroute.bench.stats import BenchResult, RequestRecord, hit_rate
from warmroute.errors import UsageError
from warmroute.workloads import Session, Workload, WorkloadRequest

BEHIND_WARNING = 0.01  # emulated engines behind their modelled speed for this share of the window: a warning


@dataclass
class BenchSettings:
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop, sessions per second
    duration_s: float = 30.0  # measured window
    warmup_s: float = 5.0
    seed: int = 0  # arrival process (the workload has its own seed)
    speedup: float = 1.0  # trace time runs this much faster
    model: str | None = None  # None: the first model the target lists, else the workload's
    timeout_s: float = 120.0  # per request
    drain_s: float = 10.0
    engine_metrics: list[str] = field(default_factory=list)  # /metrics URLs of the instances behind target
    label: str = ""
    progress: bool = False
    route: Callable[[WorkloadRequest], str] | None = None  # a client that picks each request's base URL itself

    def mode(self, workload: Workload) -> str:
        if self.rate:
            return f"open loop, {self.rate:g} sessions/s"
        if self.concurrency:
            return f"closed loop, {self.concurrency} concurrent"
        return f"trace time x{self.speedup:g}" if _timed(workload) else "closed loop, 1 concurrent"


async def run_bench(target: str, workload: Workload, settings: BenchSettings) -> BenchResult:
    """Run the workload against `target` (base URL) and summarise the measured window."""
    _check(settings)
    target = target.rstrip("/")
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = settings.model or await _served_model(session, target)
        run = _Run(session, target, workload, settings, model)
        return await run.go()


def _check(s: BenchSettings) -> None:
    if s.concurrency is not None and s.concurrency < 1:
        raise UsageError("--concurrency must be >= 1")
    if s.rate is not None and not s.rate > 0:
        raise UsageError("--rate must be > 0")
    if s.concurrency and s.rate:
        raise UsageError("choose one of --concurrency (closed loop) and --rate (open loop)")
    if not s.duration_s > 0 or s.warmup_s < 0:
        raise UsageError("--duration must be > 0 and --warmup >= 0")
    if not s.speedup > 0:
        raise UsageError("--speedup must be > 0")


def _timed(workload: Workload) -> bool:
    first = next(workload.sessions(), None)
    return first is not None and first.arrival_s is not None


async def _served_model(session: aiohttp.ClientSession, target: str) -> str | None:
    """The first model the target lists at /v1/models; also checks it is reachable at all."""
    try:
        async with session.get(target + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
    except (aiohttp.ClientConnectorError, asyncio.TimeoutError) as exc:
        raise UsageError(f"cannot reach {target}: {_reason(exc)}") from None
    except (aiohttp.ClientError, ValueError):
        return None
    models = data.get("data") if isinstance(data, dict) else None
    if isinstance(models, list) and models and isinstance(models[0], dict):
        return models[0].get("id")
    return None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer within 10 s"
    return getattr(exc, "strerror", None) or str(exc) or exc.__class__.__name__


class _Run:
    def __init__(self, session: aiohttp.ClientSession, target: str, workload: Workload,
                 settings: BenchSettings, model: str | None) -> None:
        self.session, self.target, self.workload, self.s, self.model = session, target, workload, settings, model
        self.records: list[tuple[bool, RequestRecord]] = []  # (measured, record)
        self.warm_end = settings.warmup_s
        self.window_end = settings.warmup_s + settings.duration_s
        self.t0 = 0.0
        self.stopping = False
        self.exhausted = False  # the workload ran out of sessions (a finite trace)
        self.tasks: set[asyncio.Task] = set()
        self.warnings: list[str] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def go(self) -> BenchResult:
        sessions = self.workload.sessions()
        first = next(sessions, None)  # a workload's setup (reading a trace, building its text) is not run time
        sessions = itertools.chain([] if first is None else [first], sessions)
        self.t0 = time.perf_counter()
        ticker = Ticker(self.s.label or self.workload.name, self.window_end, enabled=self.s.progress)
        feeder = asyncio.create_task(self._feed(sessions))
        try:
            with ticker:
                before = await self._counters_at(self.warm_end, ticker)
                finished = await self._wait_window(feeder, ticker)
                self.stopping = True
                end = min(self.now(), self.window_end) if finished else self.window_end
                await self._drain(feeder)
                after = await self._scrape() if before else None
        finally:  # on errors and Ctrl-C too: no request outlives the run
            self.stopping = True
            for task in (feeder, *self.tasks):
                task.cancel()
        fleet = hit_rate((after - before).hits, (after - before).queries) if before and after else None
        window = max(1e-9, end - self.warm_end)
        if before and after:
            self._warn_if_behind((after - before).behind_s, window)
        measured = [r for m, r in self.records if m]
        return BenchResult(self.s.label or self.workload.name, self.target, self.workload.name,
                           self.s.mode(self.workload), window, measured, fleet, len(self.s.engine_metrics),
                           self.warnings)

    def _warn_if_behind(self, behind_s: float, window_s: float) -> None:
        """Emulated engines that fell behind their modelled speed for over 1% of the window: say so, since their
        timings (and so these results) are then the host's, not the engines' they model."""
        instances = max(1, len(self.s.engine_metrics))
        if behind_s > BEHIND_WARNING * window_s * instances:
            self.warnings.append(f"the emulated engines fell {behind_s:.1f} s behind their modelled speed over the "
                                 f"{window_s:.0f}-s window (summed over {instances} instance"
                                 f"{'s' if instances > 1 else ''}): this host was too busy for them, so their "
                                 "timings are slower than modelled")

    # -- offering load -------------------------------------------------------------------------------------
    async def _feed(self, sessions: Iterator[Session]) -> None:
        if self.s.rate:
            await self._open_loop(sessions, self.s.rate)
        elif self.s.concurrency or not _timed(self.workload):
            await asyncio.gather(*(self._driver(sessions) for _ in range(self.s.concurrency or 1)))
        else:
            await self._trace_time(sessions)
        await asyncio.gather(*list(self.tasks), return_exceptions=True)

    def _open(self) -> bool:
        """May a new request start? Checked before every request, so no driver loops without awaiting."""
        return not self.stopping and self.now() < self.window_end

    async def _driver(self, sessions: Iterator[Session]) -> None:
        while self._open():
            session = next(sessions, None)
            if session is None:
                self.exhausted = True
                return
            await self._session(session)

    async def _open_loop(self, sessions: Iterator[Session], rate: float) -> None:
        rng, t = random.Random(self.s.seed), 0.0
        for session in sessions:
            t += rng.expovariate(rate)
            if not await self._sleep_until(t):
                return
            self._spawn(session)
        self.exhausted = True

    async def _trace_time(self, sessions: Iterator[Session]) -> None:
        start = None  # the trace's clock starts with its first request, once it is built (reading a trace takes time)
        for session in sessions:
            start = self.now() if start is None else start
            if not await self._sleep_until(start + (session.arrival_s or 0.0) / self.s.speedup):
                return
            self._spawn(session)
        self.exhausted = True

    async def _sleep_until(self, t: float) -> bool:
        """Sleep until run time t; False if the window ends first."""
        if t >= self.window_end:
            return False
        await asyncio.sleep(max(0.0, t - self.now()))
        return not self.stopping

    def _spawn(self, session: Session) -> None:
        task = asyncio.create_task(self._session(session))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _session(self, session: Session) -> None:
        for req in session.requests:
            if not self._open() or not await self._request(req):
                return

    async def _request(self, req: WorkloadRequest) -> bool:
        """Send one turn and record it; whether it was answered."""
        measured = self.now() >= self.warm_end
        start = self.now()
        try:
            target = self.s.route(req) if self.s.route else self.target
            rec = await send(self.session, target, req, model=self.model, t0=self.t0, timeout_s=self.s.timeout_s)
        except asyncio.CancelledError:  # still running when the drain ended: a failure to report, not to hide
            self.records.append((measured, RequestRecord(req.tag, start, error="unfinished")))
            raise
        self.records.append((measured, rec))
        return rec.ok

    # -- the window ----------------------------------------------------------------------------------------
    async def _wait_window(self, feeder: asyncio.Task, ticker: Ticker) -> bool:
        """Wait for the window's end; True if the workload ran out first (a finite trace)."""
        while self.now() < self.window_end:
            if feeder.done():
                if feeder.exception() is not None:
                    raise feeder.exception()  # a bug in the driver: do not hide it behind empty results
                if self.exhausted:
                    return True
            ticker.update(self.now(), *self._counts())
            await asyncio.sleep(min(0.25, max(0.0, self.window_end - self.now())))
        return False

    async def _counters_at(self, t: float, ticker: Ticker) -> CacheCounters | None:
        while self.now() < t:
            ticker.update(self.now(), *self._counts())
            await asyncio.sleep(min(0.25, t - self.now()))
        return await self._scrape()

    async def _drain(self, feeder: asyncio.Task) -> None:
        """Let in-flight requests finish for up to drain_s, then cancel what is left."""
        await asyncio.wait([feeder], timeout=self.s.drain_s)
        late = [feeder, *self.tasks]
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    async def _scrape(self) -> CacheCounters | None:
        if not self.s.engine_metrics:
            return None
        try:
            return await scrape(self.session, self.s.engine_metrics)
        except OSError as exc:
            self.warnings.append(f"fleet hit rate unavailable: {exc}")
            return None

    def _counts(self) -> tuple[int, int]:
        done = sum(1 for _, r in self.records if r.ok)
        return done, len(self.records) - done
