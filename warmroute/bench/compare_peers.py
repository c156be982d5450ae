"""The peer comparison's machinery (benchmarks/compare_peers.py): the contenders and their command lines, the
peers' virtualenv, the workload plans and their sizing, one run and its engine-load samples, the router's added
latency, the targets and the Markdown report."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any

import aiohttp

from warmroute.bench.client import send
from warmroute.bench.demo import engine_tokens_per_estimated_token
from warmroute.bench.formats import ms, number, pct, times
from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.processes import Child, free_ports
from warmroute.bench.record import ROOT
from warmroute.bench.scrape import fetch_metrics
from warmroute.bench.stats import load_spread, percentile
from warmroute.engine.tokenizer import default_tokenizer_dir
from warmroute.errors import UsageError
from warmroute.prometheus_text import read_samples
from warmroute.workloads import Workload, make_workload
from warmroute.workloads.trace import TraceRecord, TraceReplay, load_trace

PEERS_VENV = ROOT / ".peers-venv"  # git-ignored
MOONCAKE = Path(os.environ.get("WARMROUTE_MOONCAKE", ROOT.parent / "shared" / "data" / "mooncake"))
INSTANCES = 4
SAMPLE_S = 0.5  # engine /metrics sampling period (per-instance load and queues)
# Output tokens per request: routing changes prefill, which dominates TTFT, and short answers keep the Python
# processes' per-token SSE work small on a small machine.
MAX_TOKENS = 2
PEER_PACKAGES = {"smg": "smg", "vllm-router": "vllm-router"}  # command -> PyPI package


# -- contenders ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Contender:
    label: str
    router: str  # "warmroute", "smg" or "vllm-router"
    policy: str
    kv_events: bool = False  # warmroute's precise mode: the engines publish their KV events, the router follows

    @property
    def is_peer(self) -> bool:
        return self.router != "warmroute"

    def argv(self, port: int, metrics_port: int, urls: list[str], kv_capacity_tokens: int, venv: Path) -> list[str]:
        """The router's command line, at its defaults except ports, workers, policy and log level."""
        if self.router == "warmroute":
            args = [sys.executable, "-m", "warmroute", "serve", "--port", str(port), "--strategy", self.policy,
                    "--kv-capacity-tokens", str(kv_capacity_tokens), "--log-level", "warning"]
            if self.kv_events:  # it asks each engine where it publishes (GET /kv_event_sources)
                args += ["--kv-events", "--tokenizer", str(default_tokenizer_dir())]
            for i, url in enumerate(urls):
                args += ["--backend", f"engine-{i}={url}"]
            return args
        common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                  "--prometheus-port", str(metrics_port), "--policy", self.policy, "--worker-urls", *urls]
        if self.router == "smg":
            return [str(venv / "bin" / "smg"), "launch", *common, "--log-level", "warn"]
        return [str(venv / "bin" / "vllm-router"), *common, "--worker-startup-check-interval", "1",
                "--log-level", "warning"]


CONTENDERS = [
    Contender("random", "warmroute", "random"),
    Contender("prefix", "warmroute", "prefix"),
    Contender("cache_aware", "warmroute", "cache_aware"),
    Contender("precise", "warmroute", "cache_aware", kv_events=True),
    Contender("smg cache_aware", "smg", "cache_aware"),
    Contender("vllm-router cache_aware", "vllm-router", "cache_aware"),
    Contender("vllm-router consistent_hash", "vllm-router", "consistent_hash"),
]
OURS = "cache_aware"


# -- workloads and how each is loaded -----------------------------------------------------------------------------
@dataclass
class TraceWindow(TraceReplay):
    """`limit` consecutive requests of a Mooncake trace from `start`, clock restarted at 0, prompts cut to
    `max_input_tokens` (their first blocks kept, so prefix sharing within the cut is unchanged)."""

    start: int = 0
    max_input_tokens: int = 65536

    @cached_property
    def records(self) -> list[TraceRecord]:
        recs = load_trace(self.path, self.start + (self.limit or 10**9))[self.start:]
        if not recs:
            raise UsageError(f"trace {self.path} has fewer than {self.start + 1} requests")
        t0 = recs[0].timestamp_ms
        return [clip_record(replace(r, timestamp_ms=r.timestamp_ms - t0), self.max_input_tokens) for r in recs]

    @property
    def clipped(self) -> int:
        return sum(1 for r in load_trace(self.path, self.start + (self.limit or 10**9))[self.start:]
                   if r.input_length > self.max_input_tokens)


def clip_record(rec: TraceRecord, max_input_tokens: int, block_tokens: int = 512) -> TraceRecord:
    """The record with its prompt cut to max_input_tokens: input_length and hash ids shortened to match."""
    if rec.input_length <= max_input_tokens:
        return rec
    return replace(rec, input_length=max_input_tokens, hash_ids=rec.hash_ids[:-(-max_input_tokens // block_tokens)])


@dataclass(frozen=True)
class WorkloadPlan:
    """One workload and the load it is offered: closed loop (`concurrency`) or trace time (`speedup`)."""

    label: str
    workload: str  # registry name
    params: dict[str, Any] = field(default_factory=dict)
    concurrency: int | None = 16  # None: an open loop at `rate`, or the trace at its own clock / speedup
    rate: float | None = None  # open loop: requests (single-request sessions) per second
    speedup: float = 1.0
    time_scale: float = 0.5  # engine: real seconds per emulated second (emulated time dominates on 2 cores)
    max_running: int = 8
    cache_fraction: float = 0.6  # fleet KV capacity / working set (unless a request needs more, see capacity)
    trace: str = ""  # file under the Mooncake folder
    trace_start: int = 0
    trace_limit: int = 0
    window_factor: float = 1.0  # measured window = --duration x this (closed and open loops)
    description: str = ""

    def build(self, seed: int, max_tokens: int) -> Workload:
        """The workload, every request's output cut to `max_tokens`."""
        if self.trace:
            return TraceWindow(seed=seed, path=str(MOONCAKE / self.trace), limit=self.trace_limit,
                               start=self.trace_start, max_tokens=max_tokens, **self.params)
        return make_workload(self.workload, seed, max_tokens=max_tokens, **self.params)

    @property
    def closed_loop(self) -> bool:
        return self.concurrency is not None


def largest_request_tokens(workload: Workload, sample: int = 3000) -> int:
    """Prompt plus output tokens of the largest of the workload's first `sample` requests."""
    return max((r.prompt_tokens + r.max_tokens for r in islice(workload.requests(), sample)), default=1)


def kv_capacity_per_instance(working_set: int, largest_request: int, instances: int, fraction: float) -> int:
    """KV tokens per instance: `fraction` of the working set spread over the fleet, but room for at least
    two of the largest requests (an engine rejects a request it can never fit), rounded up to 1,024."""
    tokens = max(fraction * working_set / instances, 2 * largest_request, 4096)
    return int(math.ceil(tokens / 1024) * 1024)


def plans(quick: bool) -> list[WorkloadPlan]:
    trace_n = (lambda n: int(n * 0.6)) if quick else (lambda n: n)
    return [
        WorkloadPlan("mixed", "mixed", {},
                     description="45% shared system prompts, 25% RAG, 25% multi-turn chats, 5% one hot prompt"),
        WorkloadPlan("hot", "hot", {"hot": 0.6},
                     description="one hot 1,500-token prompt on 60% of requests, the rest from 40 Zipf prompts"),
        # The same traffic offered at a fixed rate: in the closed loop above every router runs at its own
        # throughput, so TTFTs there compare different loads. The rate sits just under the best peer's
        # closed-loop throughput on `hot` (docs/tuning.md).
        WorkloadPlan("hot-open", "hot", {"hot": 0.6}, concurrency=None, rate=50.0,
                     description="the hot workload as an open loop (Poisson arrivals) at a fixed rate"),
        # A conversation lives 6-12 turns, several seconds, so a normal window holds too few generations of them
        # for runs of one setting to agree: chat is measured over 4x the window (docs/tuning.md).
        # KV pressure in llm-d's shape, scaled down: equally popular ~1,500-token contexts (one customer's
        # document each) whose whole set fills 75% of the fleet's KV cache, a unique 300-token question each.
        WorkloadPlan("kv-pressure", "rag", {"docs": 60, "doc_tokens": 1500, "question_tokens": 300, "zipf": 0.0,
                                            "systems": 1, "system_tokens": 50},
                     concurrency=8, cache_fraction=1 / 0.75,
                     description="60 equally popular 1,500-token contexts filling 75% of the fleet's KV cache, "
                                 "a unique question each"),
        WorkloadPlan("chat", "chat", {"min_turns": 6, "max_turns": 12, "reply_tokens": 300},
                     concurrency=32, cache_fraction=0.9, window_factor=4.0,
                     description="long multi-turn chats: 6-12 turns, 300-token replies kept in the history"),
        WorkloadPlan("conversation", "trace", {"max_input_tokens": 32768}, concurrency=None, speedup=8.0,
                     time_scale=0.0375, max_running=16, cache_fraction=0.5, trace="conversation_trace.jsonl",
                     trace_limit=trace_n(800), description="Mooncake conversation trace, first requests"),
        WorkloadPlan("synthetic", "trace", {"max_input_tokens": 65536}, concurrency=None, speedup=2.5,
                     time_scale=0.08, max_running=16, cache_fraction=0.5, trace="synthetic_trace.jsonl",
                     trace_start=3693, trace_limit=trace_n(300),
                     description="Mooncake synthetic trace, last requests (its reuse builds up over the hour)"),
    ]


@dataclass(frozen=True)
class Sizing:
    """What a plan resolves to for a built workload."""

    working_set: int
    largest_request: int
    kv_capacity_tokens: int  # per instance
    requests: int | None  # trace requests replayed
    clipped: int  # trace prompts cut to max_input_tokens

    @property
    def fleet_over_working_set(self) -> float:
        return INSTANCES * self.kv_capacity_tokens / max(1, self.working_set)


def size(plan: WorkloadPlan, workload: Workload) -> Sizing:
    # In the engine's own tokens: its tokenizer makes fewer tokens of the workloads' text than the ~4-byte estimate.
    ws = int(workload.working_set_tokens(plan.concurrency or 1) * engine_tokens_per_estimated_token(workload))
    largest = largest_request_tokens(workload)
    cap = kv_capacity_per_instance(ws, largest, INSTANCES, plan.cache_fraction)
    if isinstance(workload, TraceWindow):
        return Sizing(ws, largest, cap, len(workload.records), workload.clipped)
    return Sizing(ws, largest, cap, None, 0)


def engine_argv(port: int, kv_capacity_tokens: int, time_scale: float, max_running: int,
                events_port: int | None = None) -> list[str]:
    events = ["--kv-events-port", str(events_port)] if events_port else []
    return ["engine", "--count", str(INSTANCES), "--port", str(port), "--kv-capacity-tokens",
            str(kv_capacity_tokens), "--time-scale", f"{time_scale:g}", "--max-running", str(max_running), *events]


# -- the peers' virtualenv ----------------------------------------------------------------------------------------
@dataclass
class PeerInstall:
    command: str
    ok: bool
    version: str = ""
    note: str = ""


def ensure_peers(venv: Path, install: bool, log: Callable[[str], None]) -> dict[str, PeerInstall]:
    """Create `venv` and pip-install each peer there (unless `install` is False); check each one's --help."""
    out: dict[str, PeerInstall] = {}
    python = venv / "bin" / "python"
    if not python.exists():
        if not install:
            return {c: PeerInstall(c, False, note=f"{venv} does not exist (--no-install)") for c in PEER_PACKAGES}
        log(f"creating {venv}")
        made = _run([sys.executable, "-m", "venv", str(venv)], 300)
        if made.returncode != 0:
            return {c: PeerInstall(c, False, note=f"cannot create {venv}: {_last_line(made)}") for c in PEER_PACKAGES}
    for command, package in PEER_PACKAGES.items():
        exe = venv / "bin" / command
        if not exe.exists() and install:
            log(f"pip install {package} into {venv}")
            done = _run([str(python), "-m", "pip", "install", "--quiet", package], 900)
            if done.returncode != 0:
                out[command] = PeerInstall(command, False, note=f"pip install {package} failed: {_last_line(done)}")
                continue
        if not exe.exists():
            out[command] = PeerInstall(command, False, note=f"{exe} not installed")
            continue
        helped = _run([str(exe), *(["launch"] if command == "smg" else []), "--help"], 60)
        if helped.returncode != 0 or "--worker-urls" not in helped.stdout:
            out[command] = PeerInstall(command, False, note=f"`{command} --help` failed: {_last_line(helped)}")
            continue
        version = _run([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"], 60)
        out[command] = PeerInstall(command, True, version=version.stdout.strip())
    return out


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(argv, 1, "", str(exc))


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [ln.strip() for ln in (done.stderr + "\n" + done.stdout).splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {done.returncode}"


# -- engine load, sampled from /metrics ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    t: float  # seconds from the sampler's start
    finished: tuple[float, ...]  # vllm:request_success_total per instance
    queued: tuple[float, ...]  # running + waiting per instance


class EngineSampler:
    """Polls every instance's /metrics: finished-request counters and queue depths over time."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = [u + "/metrics" for u in urls]
        self.samples: list[Sample] = []
        self.t0 = time.perf_counter()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineSampler:
        self._session = aiohttp.ClientSession()
        self.t0 = time.perf_counter()
        await self.sample()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.sample()
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_S)
            await self.sample()

    async def sample(self) -> None:
        assert self._session is not None
        t = time.perf_counter() - self.t0
        try:
            pages = [read_samples(text, _SAMPLED) for text in await fetch_metrics(self._session, self.urls)]
        except (OSError, ValueError):
            return
        finished = tuple(_total(p, FINISHED) for p in pages)
        queued = tuple(_total(p, RUNNING) + _total(p, WAITING) for p in pages)
        self.samples.append(Sample(t, finished, queued))


FINISHED, RUNNING, WAITING = "vllm:request_success_total", "vllm:num_requests_running", "vllm:num_requests_waiting"
_SAMPLED = (FINISHED, RUNNING, WAITING)


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


def window_load(samples: Sequence[Sample], start_s: float) -> dict[str, Any]:
    """Per-instance requests finished from `start_s` to the last sample, their max/mean, and mean queues."""
    if len(samples) < 2:
        return {"requests": [], "spread": None, "mean_queue": [], "queue_spread": None}
    first = next((s for s in samples if s.t >= start_s), samples[-1])
    last = samples[-1]
    counts = [max(0.0, b - a) for a, b in zip(first.finished, last.finished)]
    window = [s for s in samples if first.t <= s.t <= last.t] or [last]
    mean_queue = [statistics.fmean(s.queued[i] for s in window) for i in range(len(counts))]
    return {"requests": [int(c) for c in counts], "spread": spread(counts),
            "mean_queue": [round(q, 2) for q in mean_queue], "queue_spread": spread(mean_queue)}


def spread(values: Sequence[float]) -> float | None:
    """Max over mean (1.0 = even), None when all are zero."""
    return load_spread({str(i): v for i, v in enumerate(values)}, len(values)) if any(values) else None


# -- one run ------------------------------------------------------------------------------------------------------
@dataclass
class RunOutcome:
    workload: str
    contender: str
    summary: dict[str, Any] | None = None
    load: dict[str, Any] = field(default_factory=dict)
    decisions: dict[str, float] = field(default_factory=dict)  # warmroute's decision reasons
    error: str = ""
    # TTFT at the percentiles TTFT_QUANTILES (0, 1, ..., 100), ms: the distribution the figure draws
    ttft_quantiles_ms: list[float] = field(default_factory=list)


TTFT_QUANTILES = tuple(range(101))


def ttft_quantiles(ttft_ms: Sequence[float]) -> list[float]:
    """The TTFT distribution of a run in 101 numbers (percentiles 0..100): enough for a CDF, small in the JSON."""
    if not ttft_ms:
        return []
    return [round(percentile(ttft_ms, q) or 0.0, 1) for q in TTFT_QUANTILES]


async def run_one(contender: Contender, plan: WorkloadPlan, workload: Workload, sizing: Sizing,
                  args: argparse.Namespace, logs: Path) -> RunOutcome:
    """Fresh engines (cold caches) and a fresh router; the workload through it; both stopped whatever happens."""
    out = RunOutcome(plan.label, contender.label)
    tag = f"{plan.label}-{contender.label.replace(' ', '-')}"
    engine_port = free_ports(INSTANCES)
    urls = [f"http://127.0.0.1:{engine_port + i}" for i in range(INSTANCES)]
    try:
        events_port = free_ports(2 * INSTANCES, engine_port + INSTANCES) if contender.kv_events else None
        with Child(f"engines-{tag}", engine_argv(engine_port, sizing.kv_capacity_tokens, plan.time_scale,
                                                 plan.max_running, events_port), logs) as engines:
            await engines.wait_for_log("listening on", INSTANCES, timeout_s=60)
            port = free_ports(2, engine_port + INSTANCES + 2 * INSTANCES)
            argv = contender.argv(port, port + 1, urls, sizing.kv_capacity_tokens, args.peers_venv)
            with Child.command(f"router-{tag}", argv, logs) as router:
                target = f"http://127.0.0.1:{port}"
                model = await router.wait_for_model(target)
                settings = bench_settings(plan, args, model, urls, contender.label)
                async with EngineSampler(urls) as sampler:
                    result = await run_bench(target, workload, settings)
                out.summary = result.summary()
                out.ttft_quantiles_ms = ttft_quantiles(result.ttft_ms())
                out.load = window_load(sampler.samples, settings.warmup_s)
                if not contender.is_peer:
                    out.decisions = await decision_counts(target)
    except UsageError as exc:  # a child did not start: say so, go on with the others
        out.error = str(exc)
    return out


def bench_settings(plan: WorkloadPlan, args: argparse.Namespace, model: str, urls: list[str],
                   label: str) -> BenchSettings:
    window = args.duration * plan.window_factor
    if plan.closed_loop:
        return BenchSettings(concurrency=plan.concurrency, duration_s=window, warmup_s=args.warmup,
                             seed=args.seed, model=model, engine_metrics=[u + "/metrics" for u in urls],
                             label=label, drain_s=5.0)
    if plan.rate:
        return BenchSettings(rate=plan.rate, duration_s=window, warmup_s=args.warmup, seed=args.seed,
                             model=model, engine_metrics=[u + "/metrics" for u in urls], label=label, drain_s=10.0)
    return BenchSettings(duration_s=3600.0, warmup_s=args.warmup, seed=args.seed, speedup=plan.speedup, model=model,
                         engine_metrics=[u + "/metrics" for u in urls], label=label, drain_s=10.0)


async def decision_counts(target: str) -> dict[str, float]:
    """warmroute_decisions_total by reason, from the router's /metrics."""
    try:
        async with aiohttp.ClientSession() as session:
            text, = await fetch_metrics(session, [target + "/metrics"])
    except OSError:
        return {}
    return parse_decisions(text)


def parse_decisions(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in read_samples(text, ("warmroute_decisions_total",)).get("warmroute_decisions_total", []):
        out[labels.get("reason", "")] = out.get(labels.get("reason", ""), 0.0) + value
    return out


# -- the latency a router adds --------------------------------------------------------------------------------------
async def router_overhead(contender: Contender, workloads: dict[str, Workload], args: argparse.Namespace,
                          logs: Path, pairs: int) -> dict[str, Any]:
    """Median TTFT through the router minus straight to an engine, per workload, on an instant fleet."""
    tag = f"overhead-{contender.label.replace(' ', '-')}"
    engine_port = free_ports(INSTANCES)
    urls = [f"http://127.0.0.1:{engine_port + i}" for i in range(INSTANCES)]
    out: dict[str, Any] = {}
    try:
        with Child(f"engines-{tag}", engine_argv(engine_port, 1 << 20, 0.0, 256), logs) as engines:
            await engines.wait_for_log("listening on", INSTANCES, timeout_s=60)
            port = free_ports(2, engine_port + INSTANCES)
            argv = contender.argv(port, port + 1, urls, 1 << 20, args.peers_venv)
            with Child.command(f"router-{tag}", argv, logs) as router:
                target = f"http://127.0.0.1:{port}"
                model = await router.wait_for_model(target)
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                    for label, workload in workloads.items():
                        out[label] = await _paired(session, target, urls, workload, model, pairs)
    except UsageError as exc:
        out["error"] = str(exc)
    return out


async def _paired(session: aiohttp.ClientSession, target: str, urls: list[str], workload: Workload, model: str,
                  pairs: int) -> dict[str, float | None]:
    diffs, direct = [], []
    warm = 5
    for i, req in enumerate(islice(workload.requests(), pairs + warm)):
        engine = urls[i % len(urls)]
        order = [(engine, "direct"), (target, "router")]
        if i % 2:
            order.reverse()
        ttft: dict[str, float | None] = {}
        for url, which in order:
            rec = await send(session, url, req, model=model, t0=0.0, timeout_s=60)
            ttft[which] = rec.ttft_s if rec.ok else None
        if i >= warm and ttft["direct"] is not None and ttft["router"] is not None:
            diffs.append(1000 * (ttft["router"] - ttft["direct"]))
            direct.append(1000 * ttft["direct"])
    if not diffs:
        return {"added_ms": None, "direct_ttft_ms": None, "pairs": 0}
    return {"added_ms": round(statistics.median(diffs), 2), "direct_ttft_ms": round(statistics.median(direct), 2),
            "pairs": len(diffs)}


# -- ratios, targets, report (pure) ---------------------------------------------------------------------------------
# Metric: (key, title, higher is better)
METRICS: list[tuple[str, str, bool]] = [
    ("ttft_p50", "TTFT p50", False),
    ("ttft_p99", "TTFT p99", False),
    ("throughput", "throughput", True),
    ("hit_rate", "fleet hit rate", True),
    ("load_spread", "load max/mean", False),
    ("router_ms", "router adds", False),
    ("hot_ttft_p50", "hot-prompt TTFT p50", False),
]


def row_metrics(outcome: RunOutcome, overhead: dict[str, Any] | None) -> dict[str, float | None]:
    """The compared numbers of one run, flat."""
    s = outcome.summary
    if s is None:
        return {k: None for k, _, _ in METRICS}
    hot = s["by_class"].get("hot") or {}
    added = (overhead or {}).get(outcome.workload) or {}
    return {
        "ttft_p50": s["ttft_ms"]["p50"],
        "ttft_p99": s["ttft_ms"]["p99"],
        "throughput": s["throughput"]["requests_per_s"],
        "hit_rate": s["hit_rate"]["fleet"],
        "load_spread": outcome.load.get("spread"),
        "router_ms": added.get("added_ms") if isinstance(added, dict) else None,
        "hot_ttft_p50": hot.get("ttft_p50_ms"),
    }


def best_peer(rows: dict[str, dict[str, float | None]], peers: Sequence[str], key: str,
              higher_better: bool) -> float | None:
    """The best value of metric `key` among the peers that have it."""
    values = [rows[p][key] for p in peers if p in rows and rows[p].get(key) is not None]
    if not values:
        return None
    return max(values) if higher_better else min(values)  # type: ignore[type-var]


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference, None when either is unknown or the reference is not positive."""
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


@dataclass(frozen=True)
class Target:
    workload: str
    name: str
    metric: str  # key in METRICS
    ours: float | None
    bound: float | None  # what `ours` must beat (or not exceed)
    met: bool | None  # None: not measurable


def check_targets(workload: str, rows: dict[str, dict[str, float | None]], peers: Sequence[str],
                  ours: str = OURS, fixed_rate: bool = False) -> list[Target]:
    """Issue #6's targets for one workload: hit rate within one point of every peer or better, TTFT p99
    lower and throughput higher than every peer's; on `hot`, load max/mean <= 1.3 and the hot prompt's
    TTFT p50 at most half the best peer's. `fixed_rate` (an open loop, or a trace replayed on its own clock):
    throughput is the offered rate for whoever keeps up, so the target is to keep up (within 1% of the best
    peer)."""
    me = rows.get(ours, {})

    def test(name: str, metric: str, bound: float | None, ok: Callable[[float, float], bool]) -> Target:
        value = me.get(metric)
        met = None if value is None or bound is None else ok(value, bound)
        return Target(workload, name, metric, value, bound, met)

    best_hit = best_peer(rows, peers, "hit_rate", True)
    out = [
        test("hit rate >= every peer's - 1 point", "hit_rate", None if best_hit is None else best_hit - 0.01,
             lambda v, b: v >= b),
        test("TTFT p99 < every peer's", "ttft_p99", best_peer(rows, peers, "ttft_p99", False), lambda v, b: v < b),
    ]
    best_tput = best_peer(rows, peers, "throughput", True)
    if fixed_rate:
        out.append(test("throughput >= every peer's - 1% (offered rate fixed)", "throughput",
                        None if best_tput is None else 0.99 * best_tput, lambda v, b: v >= b))
    else:
        out.append(test("throughput > every peer's", "throughput", best_tput, lambda v, b: v > b))
    if is_hot(workload):
        out.append(test("load max/mean <= 1.3", "load_spread", 1.3, lambda v, b: v <= b))
        best_hot = best_peer(rows, peers, "hot_ttft_p50", False)
        out.append(test("hot TTFT p50 <= half the best peer's", "hot_ttft_p50",
                        None if best_hot is None else best_hot / 2, lambda v, b: v <= b))
    return out


def fmt(key: str, value: float | None) -> str:
    if key == "hit_rate":
        return pct(value)
    if key == "throughput":
        return number(value, 2, "/s")
    if key == "load_spread":
        return number(value, 2)
    return ms(value, 2 if key == "router_ms" else 0)


def cell(key: str, value: float | None, reference: float | None) -> str:
    return fmt(key, value) + ("" if value is None else times(ratio(value, reference), "x"))


def render_report(meta: dict[str, Any], table: dict[str, dict[str, dict[str, float | None]]],
                  outcomes: list[RunOutcome], targets: list[Target]) -> str:
    """docs/peers.md: command, setup, one table per workload (each value and its ratio to the best peer),
    targets, failures."""
    peers = [c for c in meta["contenders"] if c in meta["peer_labels"]]
    lines = [
        "# warmroute vs the peers: same emulated fleet, same traffic",
        "",
        "Regenerated by (do not edit by hand):",
        "",
        "    " + meta["command"],
        "",
        f"Run {meta['date']} on {meta['machine']}" + (f", {meta['code']}" if meta.get("code") else "")
        + f"; {meta['config']}. "
        f"Peers: {meta['peer_versions']}.",
        "",
        f"Each run: a fresh fleet of {INSTANCES} emulated instances (8b profile, cold caches), one router, the "
        f"workload through it (`warmroute.bench.run_bench`, seed {meta['seed']}, {meta['max_tokens']} output "
        "tokens per request, trace outputs included), both stopped. Ratios in brackets are to the best peer on "
        "that metric (SGLang Model Gateway and vllm-router rows); below 1 is better for latencies and load, above 1 for "
        "throughput and hit rate. Hit rate: the engines' prefix-cache counters (tokens). Load max/mean: "
        "requests each engine finished in the measured window (engine /metrics; a count, not work: a hot-prompt "
        "hit is far cheaper than a miss). Router adds: median paired "
        "TTFT difference through the router vs straight to an engine, on an instant fleet (`--time-scale 0`).",
        "",
        "| workload | load | KV tokens / instance | fleet cache / working set | time scale | what |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for w in meta["workloads"]:
        lines.append(f"| {w['label']} | {w['load']} | {w['kv_capacity_tokens']:,} | "
                     f"{w['fleet_over_working_set']:.2f} | {w['time_scale']:g} | {w['description']} |")
    for w in meta["workloads"]:
        rows = table.get(w["label"], {})
        lines += ["", f"## {w['label']}", "",
                  "| contender | " + " | ".join(t for k, t, _ in METRICS if _shown(k, w["label"])) + " |",
                  "| --- |" + " ---: |" * sum(1 for k, _, _ in METRICS if _shown(k, w["label"]))]
        refs = {k: best_peer(rows, peers, k, hi) for k, _, hi in METRICS}
        for name in meta["contenders"]:
            if name not in rows:
                continue
            values = rows[name]
            shown = [cell(k, values.get(k), refs[k]) for k, _, _ in METRICS if _shown(k, w["label"])]
            bold = f"**{name}**" if name == OURS else name
            lines.append(f"| {bold} | " + " | ".join(shown) + " |")
    lines += ["", "## Targets (issue #6): warmroute cache_aware against every peer", "",
              "| workload | target | cache_aware | bound | met |", "| --- | --- | ---: | ---: | --- |"]
    for t in targets:
        met = "n/a" if t.met is None else ("yes" if t.met else "**no**")
        lines.append(f"| {t.workload} | {t.name} | {fmt(t.metric, t.ours)} | {fmt(t.metric, t.bound)} | {met} |")
    failed = [o for o in outcomes if o.error]
    notes = list(meta.get("notes", [])) + [f"{o.workload} / {o.contender}: {o.error}" for o in failed]
    if notes:
        lines += ["", "## Not measured", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def result_json(meta: dict[str, Any], table: dict[str, dict[str, dict[str, float | None]]],
                overheads: dict[str, dict[str, Any]], targets: list[Target],
                outcomes: list[RunOutcome]) -> dict[str, Any]:
    """out/peers.json: everything measured (what `--plot-only` and the figure read back)."""
    return {"meta": meta, "table": table, "overhead": overheads, "targets": [t.__dict__ for t in targets],
            "runs": [o.__dict__ for o in outcomes]}


def is_hot(label: str) -> bool:
    """Whether a plan's workload is the hot-prompt one (its own targets and column)."""
    return any(p.label == label and p.workload == "hot" for p in plans(False))


def _shown(key: str, workload: str) -> bool:
    return key != "hot_ttft_p50" or is_hot(workload)


def load_text(plan: WorkloadPlan, sz: Sizing) -> str:
    window = f", {plan.window_factor:g}x the window" if plan.window_factor != 1.0 else ""
    if plan.closed_loop:
        return f"closed loop, {plan.concurrency} sessions{window}"
    if plan.rate:
        return f"open loop, {plan.rate:g} requests/s{window}"
    cut = plan.params.get("max_input_tokens", 0) // 1024
    clipped = f", {sz.clipped} prompts cut to {cut}k tokens" if sz.clipped else ""
    start = f" from #{plan.trace_start}" if plan.trace_start else ""
    return f"{sz.requests} trace requests{start} at x{plan.speedup:g} speed{clipped}"


def progress_line(o: RunOutcome) -> str:
    if o.summary is None:
        return f"{o.contender:<28} FAILED: {o.error}"
    s = o.summary
    return (f"{o.contender:<28} {s['requests']:>5} req, errors {sum(s['errors'].values())}, TTFT p50/p99 "
            f"{s['ttft_ms']['p50']}/{s['ttft_ms']['p99']} ms, {s['throughput']['requests_per_s']}/s, hit "
            f"{pct(s['hit_rate']['fleet'])}, load {o.load.get('requests')} "
            f"spread {o.load.get('spread') and round(o.load['spread'], 2)}")
