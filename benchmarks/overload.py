#!/usr/bin/env python3
"""Overload: the router's admission queue (flow control) against none, and against the SGLang Model Gateway.

    .venv/bin/python benchmarks/overload.py closed  [--clients 16 128] [--duration 30]
    .venv/bin/python benchmarks/overload.py surge   [--capacity R] [--high 60] [--low 60]
    .venv/bin/python benchmarks/overload.py tenants [--capacity R] [--duration 60] [--fair-share 0.25] [--repeat 3]
    .venv/bin/python benchmarks/overload.py sim-tenants [--duration 60] [--repeat 3] [--prefill-budget 2048]
    .venv/bin/python benchmarks/overload.py sim-surge [--capacity R] [--set NAME=JSON ...]

Every run: a fresh emulated fleet (--instances, 4; the 8b profile; each engine batching --max-running, 256; cold
caches) and a fresh router in front of it; contenders `flow` (cache_aware, admission on: the default), `no-flow`
(cache_aware --no-admission), `flow-defaults` (as `flow`, but surge and tenants leave --queue-timeout at its
default instead of the SLO), `direct` (no router: only with --instances 1) and, where .peers-venv holds it
(benchmarks/compare_peers.py installs it), `smg` (smg launch --policy cache_aware).

  closed   the mixed workload by N closed-loop clients (16, then 8x as many): hit rate (the engines'
           counters), throughput, TTFT p50/p99.
  surge    open loop (Poisson sessions of the mixed workload) at 2x the fleet's capacity for --high seconds,
           then 0.5x for --low: goodput (requests whose TTFT met --slo), hit rate, TTFT p50/p99 of the requests
           answered, 429s, and the recovery time (from the drop to 0.5x until every later 5-s window's TTFT p90
           is within the SLO). `flow` runs with --queue-timeout equal to the SLO: past it a request is refused.
           The surge window also reports `engines_behind_s` (below) and `cpu_cores`: the router's and the engines'
           CPU use over it (on a 2-core host they share, a router that costs more CPU slows the emulated engines).
  tenants  four tenants (x-tenant; each its own mixed workload), three at a quarter of capacity and one at 5x
           that: each tenant's goodput and TTFT p99, Jain's index over the tenants' completed request rates;
           and the three alone, for their TTFT p99 without the noisy one. --fair-share sets the fair rate.
           --repeat N runs it N times (seeds --seed, --seed+1, ...) and pools the three fair tenants' TTFTs over
           the runs: a p99 of one tenant in one run rests on a handful of requests, the pooled one on
           `tail_n` (printed, with the runs' spread). Each run also reports `engines_behind_s`: how far the
           emulated engines fell behind their modelled speed over the window (above 0, this host was too busy
           for them and the timings are partly its own).
  sim-surge  the surge in the simulator (virtual time): `flow`, `no-flow` where --contenders names it, and
           `sglang_like` (the simulator's model of SGLang's policy) in place of smg; --set changes a SimSettings
           field or strategy setting of the flow contenders, admission settings by their names (e.g. lifo_after_s=0,
           'admission={"fair_lend": 2}', shared_miss_weight=16).
  sim-tenants  the same in the simulator (virtual time: seconds, no machine noise): `flow` with this checkout's
           defaults, and, where tenant cap flags are given, `flow+caps` with them (side by side in one run);
           `no-flow` (admission off) where --contenders names it.

The capacity (requests/s the fleet serves), unless given: the simulated fleet's with --capacity-clients (128)
closed-loop clients (its engines run the model the emulated ones keep to), divided by --time-scale. --threshold sets warmroute's --concurrency-threshold for both of its
contenders.
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from warmroute.bench.client import send
from warmroute.bench.compare_peers import PEERS_VENV
from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.processes import Child, free_ports
from warmroute.bench.record import write_outputs
from warmroute.bench.scrape import CacheCounters, scrape
from warmroute.bench.stats import RequestRecord, percentile, to_ms
from warmroute.core.strategies import StrategySettings
from warmroute.sim.simulator import SimSettings, Simulation
from warmroute.workloads import Session, Workload, make_workload
from warmroute.workloads.rate_shape import RateShape
from warmroute.workloads.tenants import Tenants, TenantStream, tagged, turns_per_session

MAX_TOKENS = 16


@dataclass(frozen=True)
class Contender:
    label: str
    extra: tuple[str, ...] = ()  # warmroute serve flags; None router: the peer
    peer: bool = False
    code: Path | None = None  # run the router from this checkout (--baseline-code: before / after a change)
    direct: bool = False  # no router: the clients talk to the one engine (--instances 1)
    defaults: bool = False  # the router exactly at its defaults: no --queue-timeout set to the SLO

    def argv(self, port: int, urls: list[str], venv: Path, slo: float | None, threshold: int | None,
             flags: list[str]) -> list[str]:
        if self.peer:
            return [str(venv / "bin" / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 1), "--policy", "cache_aware",
                    "--log-level", "warn", "--worker-urls", *urls]
        args = [sys.executable, "-m", "warmroute", "serve", "--port", str(port), "--log-level", "warning", *self.extra]
        if slo is not None and "--no-admission" not in self.extra and not self.defaults:
            args += ["--queue-timeout", f"{slo:g}"]
        if threshold is not None:
            args += ["--concurrency-threshold", str(threshold)]
        if self.code is None and "--no-admission" not in self.extra:
            args += flags  # this checkout's tenant cap settings (a baseline checkout may not know them)
        for i, url in enumerate(urls):
            args += ["--backend", f"engine-{i}={url}"]
        return args


CONTENDERS = {"flow": Contender("flow"), "no-flow": Contender("no-flow", ("--no-admission",)),
              "flow-defaults": Contender("flow-defaults", defaults=True),
              "smg": Contender("smg", peer=True), "direct": Contender("direct", direct=True)}


class Stack:
    """Fresh engines and one router, stopped on exit."""

    def __init__(self, contender: Contender, args: argparse.Namespace, slo: float | None = None) -> None:
        self.contender, self.logs, self.venv, self.slo = contender, args.logs, args.peers_venv, slo
        self.threshold, self.time_scale = args.threshold, args.time_scale
        self.instances, self.max_running = args.instances, args.max_running
        self.flags = tenant_flags(args)

    async def __aenter__(self) -> Stack:
        n = self.instances
        port = free_ports(n)
        self.urls = [f"http://127.0.0.1:{port + i}" for i in range(n)]
        self.children: list[Child] = []
        try:
            engines = Child(f"engines-{self.contender.label}", [
                "engine", "--count", str(n), "--port", str(port), "--time-scale", str(self.time_scale),
                "--max-running", str(self.max_running)], self.logs)
            self.children.append(engines)
            await engines.wait_for_log("listening on", n, timeout_s=60)
            if self.contender.direct:  # no router: the one engine is the target
                self.target = self.urls[0]
                self.model = await engines.wait_for_model(self.target)
                return self
            rport = free_ports(2, port + n)
            argv = self.contender.argv(rport, self.urls, self.venv, self.slo, self.threshold, self.flags)
            if self.contender.code is not None:  # the same command from another checkout's code (PYTHONSAFEPATH:
                # `python -m` would put the working directory, this checkout, first on the path)
                argv = ["env", f"PYTHONPATH={self.contender.code}", "PYTHONSAFEPATH=1", *argv]
            router = Child.command(f"router-{self.contender.label}", argv, self.logs)
            self.children.append(router)
            self.target = f"http://127.0.0.1:{rport}"
            self.model = await router.wait_for_model(self.target)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for child in reversed(self.children):
            child.stop()

    @property
    def metrics(self) -> list[str]:
        return [u + "/metrics" for u in self.urls]


# -- closed loop ----------------------------------------------------------------------------------------------
async def closed(args: argparse.Namespace, contender: Contender, clients: int) -> dict:
    async with Stack(contender, args) as stack:
        settings = BenchSettings(concurrency=clients, duration_s=args.duration, warmup_s=args.warmup,
                                 model=stack.model, engine_metrics=stack.metrics, label=contender.label)
        s = (await run_bench(stack.target, make_workload("mixed", seed=args.seed, max_tokens=MAX_TOKENS),
                             settings)).summary()
    return {"clients": clients, "hit_rate": s["hit_rate"]["fleet"], "rps": s["throughput"]["requests_per_s"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"], "errors": s["errors"]}


def capacity(args: argparse.Namespace) -> float:
    """Requests/s (real time) the emulated fleet serves once warm: the simulated fleet's, whose engines run the
    same model (benchmarks/engine_fidelity.py: the emulation keeps to it within a few ms), at --time-scale. A
    short closed loop over HTTP would measure the fleet's cold start instead (about half of it)."""
    if args.capacity:
        return args.capacity
    rps = sim_capacity(args) / args.time_scale
    print(f"capacity: {rps:.1f} req/s at time scale {args.time_scale:g}", flush=True)
    return rps


# -- open loop with phases and tenants ----------------------------------------------------------------------------
@dataclass
class Phase:
    until_s: float
    rate: float  # requests per second offered


def mixed(seed: int) -> Workload:
    return make_workload("mixed", seed=seed, max_tokens=MAX_TOKENS)


async def offer(stack: Stack, streams: dict[str, tuple[Iterator[Session], list[Phase]]], seed: int,
                marks: list[float]) -> tuple[list[RequestRecord], list[CacheCounters | None]]:
    """Poisson session arrivals per tenant, at each phase's rate; the engines' cache counters at `marks` (s)."""
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    tasks: set[asyncio.Task] = set()
    per_session = {t: turns_per_session(mixed(seed)) for t in streams}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def session(sess: Session) -> None:
            for req in sess.requests:  # a refused turn ends the conversation (warmroute/bench/loadgen.py)
                records.append(rec := await send(http, stack.target, req, model=stack.model, t0=t0, timeout_s=120.0))
                if not rec.ok:
                    return

        async def arrivals(tenant: str, sessions: Iterator[Session], phases: list[Phase]) -> None:
            rng, t = random.Random(hash((seed, tenant)) & 0xFFFF), 0.0
            for ph in phases:
                while ph.rate > 0:  # a phase at rate 0: nobody arrives until it ends
                    t += rng.expovariate(ph.rate / per_session[tenant])
                    if t >= ph.until_s:
                        t = ph.until_s
                        break
                    await asyncio.sleep(max(0.0, t - (time.perf_counter() - t0)))
                    task = asyncio.create_task(session(next(sessions)))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                t = max(t, ph.until_s)

        async def counters() -> list[CacheCounters | None]:
            out = []
            for m in marks:
                await asyncio.sleep(max(0.0, m - (time.perf_counter() - t0)))
                out.append(await scrape(http, stack.metrics))
            return out

        feeders = [arrivals(t, s, p) for t, (s, p) in streams.items()]
        cache, *_ = await asyncio.gather(counters(), *feeders)
        if tasks:
            await asyncio.wait(tasks, timeout=130)
    return records, cache


def window_stats(recs: list[RequestRecord], start: float, end: float, slo: float,
                 before: CacheCounters | None, after: CacheCounters | None) -> dict:
    sent = [r for r in recs if start <= r.start_s < end]
    ok = [r for r in sent if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    d = (after - before) if before and after else None
    return {"sent": len(sent), "answered": len(ok), "goodput_rps": sum(t <= slo for t in ttft) / (end - start),
            "refused_429": sum(r.error == "http_429" for r in sent),
            "other_errors": sum(r.error is not None and r.error != "http_429" for r in sent),
            "hit_rate": d.hits / d.queries if d and d.queries else None,
            "engines_behind_s": round(d.behind_s, 1) if d else None,  # emulated engines' lag on this host, summed
            "ttft_p50_ms": to_ms(percentile(ttft, 50), 0), "ttft_p99_ms": to_ms(percentile(ttft, 99), 0)}


def recovery_s(recs: list[RequestRecord], drop: float, end: float, slo: float, window: float = 5.0) -> float | None:
    """Seconds from `drop` until every later `window`-s window's TTFT p90 (answered requests) is within slo."""
    starts = [drop + k * window for k in range(int((end - drop) / window))]
    good = []
    for s in starts:
        ttft = [r.ttft_s for r in recs if r.ok and r.ttft_s is not None and s <= r.start_s < s + window]
        good.append(bool(ttft) and percentile(ttft, 90) <= slo)
    for i in range(len(good)):
        if all(good[i:]):
            return starts[i] + window - drop
    return None


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a live process has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def cpu_share(children: list[Child], start: float, end: float) -> dict[str, float]:
    """Each child's CPU use, in cores, between `start` and `end` seconds from now (who this 2-core host served)."""
    await asyncio.sleep(start)
    before = {c.name: cpu_seconds(c.pid) for c in children}
    await asyncio.sleep(end - start)
    return {c.name.split("-", 1)[0]: round((cpu_seconds(c.pid) - before[c.name]) / (end - start), 2)
            for c in children}  # by role: Stack names its children "engines-LABEL" and "router-LABEL"


def surge_streams(args: argparse.Namespace, cap: float) -> dict[str, tuple[Iterator[Session], list[Phase]]]:
    """The surge's one stream for `offer`: the mixed workload at 2x `cap` for --high s, then 0.5x for --low s."""
    phases = [Phase(args.high, 2 * cap), Phase(args.high + args.low, 0.5 * cap)]
    return {"": (tagged(mixed(args.seed).sessions(), ""), phases)}


async def surge(args: argparse.Namespace, contender: Contender, cap: float) -> dict:
    high, low = args.high, args.low
    async with Stack(contender, args, slo=args.slo) as stack:
        cpu = asyncio.create_task(cpu_share(stack.children, 5.0, high))
        recs, cache = await offer(stack, surge_streams(args, cap), args.seed, [5.0, high, high + low])
        cores = await cpu
    return {"overload": {**window_stats(recs, 5.0, high, args.slo, cache[0], cache[1]), "cpu_cores": cores},
            "after": window_stats(recs, high, high + low, args.slo, cache[1], cache[2]),
            "recovery_s": recovery_s(recs, high, high + low, args.slo)}


CAP_SETTINGS = ("tenant_queue_share", "tenant_pending", "prefill_budget")


def tenant_flags(args: argparse.Namespace) -> list[str]:
    """`warmroute serve` flags: --trust-client-headers (the load generator names each request's tenant in x-tenant,
    as a gateway would), and the tenant caps (--tenant-queue-share, --tenant-pending, --prefill-budget) where given."""
    flags = ["--trust-client-headers"]
    for name in CAP_SETTINGS:
        value = getattr(args, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), f"{value:g}"]
    return flags


def jain(xs: list[float]) -> float | None:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else None


FAIR = ("a", "b", "c")  # the fair tenants (the noisy one: "noisy")


def tenant_rates(cap: float, share: float, noisy: bool) -> dict[str, float]:
    """Three fair tenants at `share` of the capacity each, and the noisy one at 5x that."""
    return {**{t: cap * share for t in FAIR}, **({"noisy": 5 * cap * share} if noisy else {})}


def noisy_from(args: argparse.Namespace, tenant: str) -> float:
    """When `tenant` starts sending: the fair ones at once, the noisy one at --noisy-from (set it to --warmup for a
    tenant joining a fleet the others warmed, its arrival measured)."""
    return 0.0 if tenant in FAIR else args.noisy_from


def tail_split(recs: list[tuple[str, float, float | None, float]], warmup: float, who: tuple[str, ...]) -> dict:
    """Where `who`'s slowest requests (TTFT at or above their p99) spent it: waiting in the router, then after
    it (sending, the engine's queue and prefill), in ms, from (tenant, start s, TTFT s or None, queued s)."""
    mine = [(t, q) for who_, start, t, q in recs if who_ in who and start >= warmup and t is not None]
    p99 = percentile([t for t, _ in mine], 99)
    tail = [(t, q) for t, q in mine if p99 is not None and t >= p99]
    if not tail:
        return {}
    return {"tail_n": len(tail), "tail_queued_ms": round(1000 * sum(q for _, q in tail) / len(tail)),
            "tail_after_ms": round(1000 * sum(t - q for t, q in tail) / len(tail)),
            "queued_p50_ms": to_ms(percentile([q for _, q in mine], 50), 0),
            "after_p50_ms": to_ms(percentile([t - q for t, q in mine], 50), 0)}


def tenant_stats(args: argparse.Namespace, rates: dict[str, float],
                 recs: list[tuple[str, float, float | None]], refused: dict[str, int]) -> dict:
    """Per tenant, from (tenant, start s, TTFT s or None) of every request: completed and goodput rates of
    those started after the warm-up, TTFT p99, 429s; Jain's index over the completed rates."""
    span = args.duration - args.warmup
    out: dict = {}
    for t in rates:
        ttft = [x for who, start, x in recs if who == t and start >= args.warmup and x is not None]
        out[t] = {"completed_rps": round(len(ttft) / span, 2),
                  "goodput_rps": round(sum(x <= args.slo for x in ttft) / span, 2),
                  "ttft_p50_ms": to_ms(percentile(ttft, 50), 0), "ttft_p99_ms": to_ms(percentile(ttft, 99), 0),
                  "refused_429": refused.get(t, 0)}
    out["jain"] = jain([out[t]["completed_rps"] for t in rates])
    return out


def fair_ttfts(args: argparse.Namespace, recs: list[tuple[str, float, float | None]]) -> list[float]:
    """The fair tenants' TTFTs (s) of the requests started after the warm-up and answered."""
    return [x for who, start, x in recs if who in FAIR and start >= args.warmup and x is not None]


def tail_size(xs: list[float], q: float = 99) -> int:
    """How many samples lie at or above the q-th percentile: what that percentile rests on."""
    p = percentile(xs, q)
    return 0 if p is None else sum(x >= p for x in xs)


def pooled_fair(alone: list[list[float]], noisy: list[list[float]]) -> dict:
    """The fair tenants' TTFT p99 with the noisy one over theirs alone: per run (the three pooled), and over all
    runs pooled, with the samples each p99 rests on."""
    def ratio(a: list[float], n: list[float]) -> float | None:
        pa, pn = percentile(a, 99), percentile(n, 99)
        return round(pn / pa, 2) if pa and pn is not None else None

    all_a, all_n = [x for xs in alone for x in xs], [x for xs in noisy for x in xs]
    return {"runs": len(alone), "ratio_per_run": [ratio(a, n) for a, n in zip(alone, noisy)],
            "p99_alone_per_run_ms": [to_ms(percentile(a, 99), 0) for a in alone],
            "p99_noisy_per_run_ms": [to_ms(percentile(n, 99), 0) for n in noisy],
            "pooled_p99_alone_ms": to_ms(percentile(all_a, 99), 0),
            "pooled_p99_noisy_ms": to_ms(percentile(all_n, 99), 0),
            "pooled_ratio": ratio(all_a, all_n), "samples": [len(all_a), len(all_n)],
            "tail_n": [tail_size(all_a), tail_size(all_n)]}


def tenant_summary(runs: list[tuple[dict, list[float], dict, list[float]]]) -> dict:
    """Over repeated (alone stats, alone fair TTFTs, with-noisy stats, with-noisy fair TTFTs): the pooled fair p99
    ratio, and per run Jain's index, the fleet's completed req/s and hit rate with the noisy one, the per-tenant
    p99 ratios."""
    out = pooled_fair([r[1] for r in runs], [r[3] for r in runs])
    out["jain_per_run"] = [round(r[2]["jain"], 3) if r[2]["jain"] is not None else None for r in runs]
    out["fleet_rps_per_run"] = [round(sum(v["completed_rps"] for k, v in r[2].items() if k in (*FAIR, "noisy")), 2)
                                for r in runs]
    out["hit_rate_per_run"] = [r[2].get("hit_rate") for r in runs]
    out["tenant_ratios_per_run"] = [[round(r[2][t]["ttft_p99_ms"] / r[0][t]["ttft_p99_ms"], 2)
                                     if r[0][t]["ttft_p99_ms"] and r[2][t]["ttft_p99_ms"] else None for t in FAIR]
                                    for r in runs]
    return out


async def tenants(args: argparse.Namespace, contender: Contender, cap: float, noisy: bool,
                  seed: int) -> tuple[dict, list[float]]:
    rates = tenant_rates(cap, args.fair_share, noisy)
    async with Stack(contender, args, slo=args.slo) as stack:
        streams = {t: (tagged(mixed(seed + i).sessions(), t),
                       [Phase(noisy_from(args, t), 0.0), Phase(args.duration, r)])
                   for i, (t, r) in enumerate(rates.items())}
        recs, cache = await offer(stack, streams, seed, [args.warmup, args.duration])
    d = (cache[1] - cache[0]) if cache[0] and cache[1] else None
    done = [(r.tenant, r.start_s, r.ttft_s if r.ok else None) for r in recs]
    refused: dict[str, int] = {}
    for r in recs:
        if r.error == "http_429" and r.start_s >= args.warmup:
            refused[r.tenant] = refused.get(r.tenant, 0) + 1
    split = [(r.tenant, r.start_s, r.ttft_s if r.ok else None, r.queued_s or 0.0) for r in recs]
    hit = round(d.hits / d.queries, 4) if d and d.queries else None
    behind = round(d.behind_s, 1) if d else None  # emulated engines' lag on this host, summed, over the window
    return ({"hit_rate": hit, "engines_behind_s": behind, **tenant_stats(args, rates, done, refused),
             "fair_tail": tail_split(split, args.warmup, FAIR)}, fair_ttfts(args, done))


def sim_tenants(args: argparse.Namespace, admission: bool, noisy: bool, cap: float, seed: int,
                caps: dict[str, float]) -> tuple[dict, list[float]]:
    """The noisy-tenant run in the simulator: the same fleet (4 instances of the 8b profile, max_running 256,
    the threshold), workloads and rates, in virtual time (no machine noise); strategy cache_aware."""
    rates = tenant_rates(cap, args.fair_share, noisy)
    streams = tuple(TenantStream(t, mixed(seed + i), r, start_s=noisy_from(args, t))
                    for i, (t, r) in enumerate(rates.items()))
    workload = Tenants(streams=streams, duration_s=args.duration)
    knobs = {**caps, **({"fair_lend": args.fair_lend} if args.fair_lend is not None else {})}
    res = Simulation(sim_settings(args, admission, knobs, seed=seed), workload, "cache_aware").run()
    done = [(x.tenant, x.arrival, x.first_token - x.arrival if x.first_token is not None else None)
            for x in res.records if x.arrival < args.duration]
    split = [(x.tenant, x.arrival, x.first_token - x.arrival if x.first_token is not None else None,
              x.sent - x.arrival) for x in res.records if x.arrival < args.duration]
    return ({"hit_rate": round(res.hit_rate, 4), **tenant_stats(args, rates, done, res.rejected_by_tenant),
             "fair_tail": tail_split(split, args.warmup, FAIR)}, fair_ttfts(args, done))


def sim_settings(args: argparse.Namespace, admission: bool, knobs: dict[str, object] | None = None,
                 **changes: object) -> SimSettings:
    """The simulated fleet; `knobs`: admission settings by their names (AdmissionConfig: fair_lend, ...)."""
    queue = {"enabled": admission, "timeout_s": args.slo / args.time_scale, **(knobs or {})}
    routing = StrategySettings(**({"concurrency_threshold": args.threshold} if args.threshold else {}), admission=queue)
    s = SimSettings(instances=args.instances, max_running=args.max_running, routing=routing, requests=10**7,
                    seed=args.seed)
    return dataclasses.replace(s, **changes)


def sim_surge_settings(args: argparse.Namespace, admission: bool, cap: float) -> SimSettings:
    """The simulated fleet offered `surge`'s load: sessions of the mixed workload at 2x `cap`, then 0.5x."""
    shape = RateShape(((0.0, 2.0), (args.high, 0.5), (args.high + args.low, 0.0)))
    return sim_settings(args, admission, rate=cap / turns_per_session(mixed(args.seed)), rate_shape=shape)


def sim_surge(args: argparse.Namespace, strategy: str, admission: bool, cap: float,
              changes: list[str]) -> dict:
    """The surge in the simulator: the same fleet, workload, phases, SLO and goodput window as `surge`."""
    s = sim_surge_settings(args, admission, cap)
    for item in changes:
        name, value = item.split("=", 1)
        s = s.changed(name, json.loads(value))
    res = Simulation(s, mixed(args.seed), strategy).run()
    window = [x for x in res.records if 5.0 <= x.arrival < args.high]
    ttft = [x.first_token - x.arrival for x in window if x.first_token is not None]
    return {"goodput_rps": round(sum(t <= args.slo for t in ttft) / (args.high - 5.0), 1),
            "refused_429": sum(5.0 <= t < args.high for t in res.rejected_at), "hit_rate": round(res.hit_rate, 4),
            "ttft_p50_ms": to_ms(percentile(ttft, 50), 0), "ttft_p99_ms": to_ms(percentile(ttft, 99), 0)}


def sim_capacity(args: argparse.Namespace) -> float:
    """Requests/s the simulated fleet serves to --capacity-clients closed-loop clients of the mixed workload."""
    if args.capacity:
        return args.capacity
    s = sim_settings(args, True, concurrency=args.capacity_clients, requests=4000)
    res = Simulation(s, mixed(args.seed), "cache_aware").run()
    cap = sum(x.done is not None for x in res.records) / res.duration_s
    print(f"capacity: {cap:.1f} req/s ({args.capacity_clients} closed-loop clients, simulated)", flush=True)
    return cap


Runner = Callable[[bool, int], Awaitable[tuple[dict, list[float]]]]  # (noisy, seed) -> stats, fair TTFTs


async def tenant_runs(args: argparse.Namespace, runners: dict[str, Runner], results: dict) -> None:
    """--repeat runs of a tenants scenario (alone, then with the noisy one), the contenders in turn within each
    run (so they share the machine's state), and each contender's summary over the runs."""
    runs: dict[str, list] = {label: [] for label in runners}
    for k in range(args.repeat):
        for label, run in runners.items():
            pair: list = []
            for noisy in (False, True):
                r, fair = await run(noisy, args.seed + k)
                results[f"{label} {'with' if noisy else 'without'} noisy seed {args.seed + k}"] = r
                print(label, "noisy" if noisy else "alone", f"seed {args.seed + k}", json.dumps(r), flush=True)
                pair += [r, fair]
            runs[label].append(tuple(pair))
    for label in runners:
        results[f"{label} summary"] = summary = tenant_summary(runs[label])
        print(label, "SUMMARY", json.dumps(summary), flush=True)


def http_runner(args: argparse.Namespace, c: Contender, cap: float) -> Runner:
    return lambda noisy, seed: tenants(args, c, cap, noisy, seed)


def sim_runner(args: argparse.Namespace, admission: bool, cap: float, caps: dict[str, float]) -> Runner:
    async def run(noisy: bool, seed: int) -> tuple[dict, list[float]]:
        return sim_tenants(args, admission, noisy, cap, seed, caps)
    return run


# -- main -------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=("closed", "surge", "tenants", "sim-tenants", "sim-surge"))
    p.add_argument("--contenders", nargs="+", default=["flow", "no-flow", "smg"], choices=sorted(CONTENDERS))
    p.add_argument("--clients", nargs="+", type=int, default=[16, 128])
    p.add_argument("--instances", type=int, default=4, help="emulated engines (direct: 1)")
    p.add_argument("--max-running", type=int, default=256, help="each engine's largest running batch")
    p.add_argument("--duration", type=float, default=30.0, help="closed: measured s; tenants: whole run s")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--capacity", type=float, help="requests/s the fleet serves (default: measured first)")
    p.add_argument("--capacity-clients", type=int, default=128, help="closed-loop clients measuring capacity")
    p.add_argument("--threshold", type=int, help="warmroute's --concurrency-threshold (default: its default)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                   help="sim-surge: a SimSettings field or strategy setting for the flow contenders (repeatable)")
    p.add_argument("--high", type=float, default=60.0, help="surge: seconds at 2x capacity")
    p.add_argument("--low", type=float, default=60.0, help="surge: seconds at 0.5x capacity after")
    p.add_argument("--slo", type=float, default=2.0,
                   help="TTFT SLO, seconds of the emulated engine's time (goodput; x --time-scale in real time)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="the emulated engines' real seconds per modelled second: 2 halves the request rates the "
                        "shared machine must drive")
    p.add_argument("--fair-share", type=float, default=0.25,
                   help="tenants: each fair tenant's rate, as a share of the capacity (the noisy one: 5x that)")
    p.add_argument("--noisy-from", type=float, default=0.0,
                   help="tenants: seconds after the start at which the noisy tenant joins (default: at once)")
    p.add_argument("--fair-lend", type=float, help="sim-tenants: the admission queue's fair_lend (default: its own)")
    p.add_argument("--tenant-queue-share", type=float,
                   help="warmroute's --tenant-queue-share (flow contenders and the simulator; default: its own)")
    p.add_argument("--tenant-pending", type=int,
                   help="warmroute's --tenant-pending (flow contenders and the simulator; default: its own)")
    p.add_argument("--prefill-budget", type=int,
                   help="warmroute's --prefill-budget (flow contenders and the simulator; default: its own)")
    p.add_argument("--repeat", type=int, default=1,
                   help="tenants, sim-tenants: runs (seeds --seed, --seed+1, ...), the fair tenants' p99 pooled")
    p.add_argument("--baseline-code", type=Path, nargs="+", default=[], metavar="DIR",
                   help="add a contender `flow@DIR` per DIR: flow with the router from that checkout (before a "
                        "change)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers-venv", type=Path, default=PEERS_VENV)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if "direct" in args.contenders and args.instances != 1:
        p.error("the direct contender needs --instances 1 (with several engines, no router is no single target)")
    args.slo *= args.time_scale
    return args


async def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.logs = Path(tempfile.mkdtemp(prefix="warmroute-overload-"))
    contenders = [CONTENDERS[c] for c in args.contenders
                  if not CONTENDERS[c].peer or (args.peers_venv / "bin" / "smg").exists()]
    for code in reversed(args.baseline_code):
        contenders.insert(0, Contender(f"flow@{code.name}", code=code.resolve()))
    results: dict = {"scenario": args.scenario, "argv": argv}
    if args.scenario == "sim-tenants":
        results["capacity_rps"] = cap = sim_capacity(args)
        caps = {n: getattr(args, n) for n in CAP_SETTINGS if getattr(args, n) is not None}
        runners = {"flow": sim_runner(args, True, cap, {})}
        if caps:
            runners["flow+caps"] = sim_runner(args, True, cap, caps)
        if "no-flow" in args.contenders:
            runners["no-flow"] = sim_runner(args, False, cap, {})
        await tenant_runs(args, runners, results)
    elif args.scenario == "sim-surge":
        results["capacity_rps"] = cap = sim_capacity(args)
        runs = [("flow", "cache_aware", True, args.set), ("sglang_like", "sglang_like", False, [])]
        if "no-flow" in args.contenders:
            runs.insert(1, ("no-flow", "cache_aware", False, args.set))
        for label, strategy, admission, changes in runs:
            results[label] = r = sim_surge(args, strategy, admission, cap, changes)
            print(label, json.dumps(r), flush=True)
    elif args.scenario == "closed":
        for c in contenders:
            for n in args.clients:
                results[f"{c.label} {n}"] = r = await closed(args, c, n)
                print(c.label, json.dumps(r), flush=True)
    else:
        cap = capacity(args)
        results["capacity_rps"] = cap
        if args.scenario == "tenants":
            await tenant_runs(args, {c.label: http_runner(args, c, cap) for c in contenders}, results)
        for c in contenders if args.scenario == "surge" else ():
            results[c.label] = r = await surge(args, c, cap)
            print(c.label, json.dumps(r), flush=True)
    if args.json:
        write_outputs(args.json, results)
    print(f"logs: {args.logs}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
