"""The saturation benchmark's machinery (benchmarks/saturation.py): the contenders, the trivial fleets, one
measured window of each phase (closed-loop saturation, paired streams for added latency), rounds in ABBA order,
their summaries and the docs/benchmarks.md fragment."""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmroute.bench import compare_peers as cp
from warmroute.bench.cpu import CpuMeter
from warmroute.bench.formats import number, times, us
from warmroute.bench.processes import Child, free_ports
from warmroute.bench.rawload import ClosedLoop, PairedStreams, hostport, measured
from warmroute.bench.record import log
from warmroute.bench.stats import percentile, to_ms
from warmroute.errors import UsageError

SECTION = "Saturation throughput and added latency (issue #2)"
INSTANCES = 4
KV_CAPACITY = 1 << 20  # warmroute's configured capacity per instance: large, nothing is ever evicted
TARGET_P50_MS, TARGET_P99_MS = 1.0, 3.0

SYSTEM_PROMPTS = [
    f"You are assistant number {i}. " + " ".join(
        ["Answer briefly and precisely.", "Cite nothing you cannot check.", "Prefer plain words.",
         "Keep every answer under three sentences.", "If a question is unclear, say what is missing.",
         "Never invent numbers.", "Use metric units.", "Write for a busy engineer."][(i + k) % 8]
        for k in range(8))
    for i in range(8)
]


# -- contenders and fleets ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Contender:
    label: str
    router: str | None  # None: straight to the instances; "warmroute" or "smg"
    workers: int = 1

    @property
    def is_peer(self) -> bool:
        return self.router not in (None, "warmroute")

    def argv(self, port: int, urls: list[str], venv: Path) -> list[str]:
        """compare_peers' command line for this router (cache_aware, defaults otherwise), plus --workers."""
        assert self.router is not None
        args = cp.Contender(self.label, self.router, "cache_aware").argv(port, port + 1, urls, KV_CAPACITY, venv)
        return args + (["--workers", str(self.workers)] if self.workers > 1 else [])


CONTENDERS = [
    Contender("direct", None),
    Contender("warmroute", "warmroute"),
    Contender("warmroute x2", "warmroute", workers=2),
    Contender("smg", "smg"),
]
PEER = "smg"


@dataclass(frozen=True)
class FleetSpec:
    """Trivial instances: `stub` (warmroute.bench.trivial) or `engine` (warmroute engine --time-scale 0)."""

    kind: str
    instances: int = INSTANCES
    processes: int = 1
    itl_ms: float = 0.0  # stub only: paced streams

    def counts(self) -> list[int]:
        """Instances per process."""
        per = -(-self.instances // self.processes)
        return [n for n in (min(per, self.instances - p * per) for p in range(self.processes)) if n > 0]

    def children(self, port: int, logs: Path, tag: str) -> list[Child]:
        out: list[Child] = []
        first = port
        try:
            for p, count in enumerate(self.counts()):
                if self.kind == "stub":
                    args = ["--count", str(count), "--port", str(first), "--itl-ms", f"{self.itl_ms:g}"]
                    out.append(Child(f"{tag}-{p}", args, logs, module="warmroute.bench.trivial"))
                else:
                    args = ["engine", "--count", str(count), "--port", str(first), "--time-scale", "0",
                            "--kv-capacity-tokens", str(KV_CAPACITY), "--max-running", "256"]
                    out.append(Child(f"{tag}-{p}", args, logs))
                first += count
        except BaseException:
            for c in out:
                c.stop()
            raise
        return out

    def describe(self) -> str:
        procs = f"{self.processes} process{'es' if self.processes > 1 else ''}"
        if self.kind == "stub":
            paced = f", tokens {self.itl_ms:g} ms apart" if self.itl_ms else ""
            return f"{self.instances} trivial instances (warmroute.bench.trivial) in {procs}{paced}"
        return f"{self.instances} emulated engines (`warmroute engine --time-scale 0`) in {procs}"


# -- request bodies -----------------------------------------------------------------------------------------------
def request_bodies(model: str, count: int, stream: Callable[[int], bool], max_tokens: int,
                   salt: int = 0) -> list[bytes]:
    """`count` chat completions: a system prompt of 8, a short question; streamed ones ask for usage."""
    out = []
    for i in range(count):
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "system", "content": SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]},
                         {"role": "user", "content": f"Question {salt}-{i}: what is {i} times {salt % 97 + 3}?"}],
            "max_tokens": max_tokens,
        }
        if stream(i):
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        out.append(json.dumps(body, separators=(",", ":")).encode())
    return out


# -- the runs -----------------------------------------------------------------------------------------------------
@dataclass
class Running:
    """A started fleet and the routers in front of it."""

    fleet: FleetSpec
    children: list[Child]
    urls: list[str]
    routers: dict[str, tuple[Child, str]]  # contender label -> (process, base URL)
    model: str
    notes: list[str] = field(default_factory=list)

    def sids(self) -> dict[str, list[int]]:
        groups = {"instances": [c.proc.pid for c in self.children]}
        for label, (proc, _) in self.routers.items():
            groups[label] = [proc.proc.pid]
        return groups

    def stop(self) -> None:
        for proc, _ in self.routers.values():
            proc.stop()
        for c in self.children:
            c.stop()


async def start_fleet(fleet: FleetSpec, contenders: Sequence[Contender], venv: Path, logs: Path,
                      tag: str) -> Running:
    port = free_ports(fleet.instances + 2 * len(contenders))
    urls = [f"http://127.0.0.1:{port + i}" for i in range(fleet.instances)]
    children = fleet.children(port, logs, f"{tag}-instances")
    running = Running(fleet, children, urls, {}, "")
    try:
        for child, count in zip(children, fleet.counts()):
            await child.wait_for_log("listening on", count, timeout_s=60)
        next_port = port + fleet.instances
        for c in contenders:
            if c.router is None:
                continue
            rport = free_ports(2, next_port)
            next_port = rport + 2
            proc = Child.command(f"{tag}-{c.label.replace(' ', '-')}", c.argv(rport, urls, venv), logs)
            target = f"http://127.0.0.1:{rport}"
            try:
                running.model = await proc.wait_for_model(target)
            except UsageError as exc:
                proc.stop()
                running.notes.append(f"{c.label} ({fleet.kind}): {exc}")
                log(f"   {c.label} did not start: {exc}")
                continue
            running.routers[c.label] = (proc, target)
        if not running.model:
            running.model = await children[0].wait_for_model(urls[0])
    except BaseException:
        running.stop()
        raise
    return running


async def saturation_window(running: Running, contender: Contender, args: argparse.Namespace,
                            meter: CpuMeter) -> dict[str, Any]:
    if contender.router is None:
        targets = [hostport(u) for u in running.urls]
    else:
        targets = [hostport(running.routers[contender.label][1])]
    bodies = request_bodies(running.model, 256, lambda i: i % 2 == 1, args.max_tokens,
                            salt=random.randrange(1 << 20))
    load = ClosedLoop(targets, "/v1/chat/completions", bodies, args.connections)
    await load.start()
    a, b = await measured(load, args.warmup, args.duration, meter)
    w, wall = load.window, b[0] - a[0]
    lat = sorted(w.latency_s)
    ttft = sorted(w.ttft_s)
    return {
        "contender": contender.label, "fleet": running.fleet.kind, "requests": w.ok, "errors": w.errors,
        "seconds": round(wall, 3), "rps": round(w.ok / wall, 1),
        "latency_ms": {"p50": to_ms(percentile(lat, 50)), "p99": to_ms(percentile(lat, 99))},
        "stream_ttft_ms": {"p50": to_ms(percentile(ttft, 50)), "p99": to_ms(percentile(ttft, 99))},
        "cpu_cores": meter.cores(a, b),
    }


async def latency_window(running: Running, contender: Contender, args: argparse.Namespace,
                         meter: CpuMeter) -> dict[str, Any]:
    bodies = request_bodies(running.model, 256, lambda i: True, args.stream_tokens, salt=random.randrange(1 << 20))
    pairs = PairedStreams([hostport(u) for u in running.urls], hostport(running.routers[contender.label][1]),
                          "/v1/chat/completions", bodies, args.streams)
    stream_s = args.stream_tokens * args.itl_ms / 1000
    await pairs.start(stagger_s=stream_s)
    a, b = await measured(pairs, args.warmup + stream_s, args.duration, meter)
    return {"contender": contender.label, "pairs": [[round(d, 6), round(r, 6)] for d, r in pairs.pairs],
            "errors": pairs.errors, "seconds": round(b[0] - a[0], 3), "cpu_cores": meter.cores(a, b)}


def round_orders(contenders: Sequence[Contender], rounds: int) -> list[list[Contender]]:
    """ABBA: each round every contender once, the order reversed every other round."""
    return [list(contenders) if r % 2 == 0 else list(reversed(contenders)) for r in range(rounds)]


async def run_rounds(running: Any, present: Sequence[Contender], args: argparse.Namespace,
                     window: Callable[..., Any], line: Callable[[Contender, dict[str, Any]], str]) -> list[dict[str, Any]]:
    """Every contender's measured window, round after round in ABBA order, each logged with `line`."""
    out: list[dict[str, Any]] = []
    meter = CpuMeter(running.sids())
    for r, order in enumerate(round_orders(present, args.rounds)):
        for c in order:
            res = await window(running, c, args, meter)
            res["round"] = r
            out.append(res)
            log(f"   round {r} {c.label:<13} " + line(c, res))
    return out


async def phase_saturation(fleet: FleetSpec, contenders: Sequence[Contender], args: argparse.Namespace,
                           logs: Path) -> tuple[list[dict[str, Any]], list[str]]:
    log(f"== (a) saturation, {fleet.describe()}")
    running = await start_fleet(fleet, contenders, args.peers_venv, logs, f"sat-{fleet.kind}")
    def line(c: Contender, res: dict[str, Any]) -> str:
        cpu = res["cpu_cores"]
        return (f"{res['rps']:>9,.0f} req/s  errors {sum(res['errors'].values())}  cores: router "
                f"{cpu.get(c.label, 0.0):.2f} instances {cpu['instances']:.2f} loadgen {cpu['load generator']:.2f} "
                f"other {cpu['other processes']:.2f}")

    try:
        present = [c for c in contenders if c.router is None or c.label in running.routers]
        out = await run_rounds(running, present, args, saturation_window, line)
    finally:
        running.stop()
    return out, running.notes


async def phase_latency(contenders: Sequence[Contender], args: argparse.Namespace,
                        logs: Path) -> tuple[list[dict[str, Any]], list[str], FleetSpec]:
    fleet = FleetSpec("stub", instances=args.latency_instances, itl_ms=args.itl_ms)
    routed = [c for c in contenders if c.router is not None]
    log(f"== (b) added latency, {args.streams} concurrent streams, {fleet.describe()}")
    running = await start_fleet(fleet, routed, args.peers_venv, logs, "lat")
    def line(c: Contender, res: dict[str, Any]) -> str:
        s = latency_summary(res["pairs"])
        return (f"{len(res['pairs']):>6} pairs  errors {sum(res['errors'].values())}  TTFT p50 {s['direct_p50']} -> "
                f"{s['router_p50']} ms, p99 {s['direct_p99']} -> {s['router_p99']} ms  machine "
                f"{res['cpu_cores']['machine']:.2f} cores")

    try:
        present = [c for c in routed if c.label in running.routers]
        out = await run_rounds(running, present, args, latency_window, line)
    finally:
        running.stop()
    return out, running.notes, fleet


# -- summaries (pure) ---------------------------------------------------------------------------------------------
def latency_summary(pairs: Sequence[Sequence[float]]) -> dict[str, Any]:
    """TTFT percentiles (ms) straight and through the router, their differences, and the paired differences."""
    direct = [1000 * d for d, _ in pairs]
    routed = [1000 * r for _, r in pairs]
    diffs = [r - d for d, r in zip(direct, routed)]

    def q(xs: list[float], p: float) -> float | None:
        v = percentile(xs, p)
        return None if v is None else round(v, 3)

    out: dict[str, Any] = {"pairs": len(pairs)}
    for p in (50, 99):
        out[f"direct_p{p}"], out[f"router_p{p}"] = q(direct, p), q(routed, p)
        out[f"added_p{p}"] = (None if out[f"direct_p{p}"] is None
                              else round(out[f"router_p{p}"] - out[f"direct_p{p}"], 3))
        out[f"paired_p{p}"] = q(diffs, p)
    return out


def saturation_summary(windows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per contender: median req/s over the rounds, every round's, the median ratio to smg within a round, errors,
    and median cores used per component (and CPU µs per request)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for w in windows:
        by.setdefault(w["contender"], []).append(w)
    peer_by_round = {w["round"]: w["rps"] for w in by.get(PEER, [])}
    out: dict[str, dict[str, Any]] = {}
    for label, ws in by.items():
        ratios = [w["rps"] / peer_by_round[w["round"]] for w in ws if peer_by_round.get(w["round"])]
        keys = ws[0]["cpu_cores"].keys()
        cores = {k: round(statistics.median(w["cpu_cores"].get(k, 0.0) for w in ws), 2) for k in keys}
        rps = statistics.median(w["rps"] for w in ws)
        router_us = None
        if label != "direct" and label in cores and rps:
            router_us = round(1e6 * cores[label] / rps, 1)
        out[label] = {
            "rps": round(rps, 1), "rounds": [w["rps"] for w in ws],
            "ratio_to_peer": round(statistics.median(ratios), 3) if ratios else None,
            "errors": sum(sum(w["errors"].values()) for w in ws),
            "requests": sum(w["requests"] for w in ws),
            "latency_p50_ms": statistics.median(w["latency_ms"]["p50"] or 0 for w in ws),
            "latency_p99_ms": statistics.median(w["latency_ms"]["p99"] or 0 for w in ws),
            "cores": cores, "router_cpu_us_per_request": router_us,
            "instances_cpu_us_per_request": round(1e6 * cores.get("instances", 0) / rps, 1) if rps else None,
            "loadgen_cpu_us_per_request": round(1e6 * cores.get("load generator", 0) / rps, 1) if rps else None,
        }
    peer_us = out.get(PEER, {}).get("router_cpu_us_per_request")
    for row in out.values():
        cpu_us = row["router_cpu_us_per_request"]
        row["per_core_ratio_to_peer"] = round(peer_us / cpu_us, 3) if cpu_us and peer_us else None
    return out


def latency_by_contender(windows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for w in windows:
        by.setdefault(w["contender"], []).append(w)
    out = {}
    for label, ws in by.items():
        s = latency_summary([p for w in ws for p in w["pairs"]])
        s["errors"] = sum(sum(w["errors"].values()) for w in ws)
        s["rounds_added_p50"] = [latency_summary(w["pairs"])["added_p50"] for w in ws]
        s["rounds_added_p99"] = [latency_summary(w["pairs"])["added_p99"] for w in ws]
        s["machine_cores"] = round(statistics.median(w["cpu_cores"]["machine"] for w in ws), 2)
        s["router_cores"] = round(statistics.median(w["cpu_cores"].get(label, 0.0) for w in ws), 2)
        out[label] = s
    return out


def latency_met(s: dict[str, Any] | None) -> bool | None:
    if not s or s.get("added_p50") is None:
        return None
    return s["added_p50"] <= TARGET_P50_MS and s["added_p99"] <= TARGET_P99_MS


# -- report (pure) ------------------------------------------------------------------------------------------------
def render_section(meta: dict[str, Any], sat: dict[str, dict[str, dict[str, Any]]],
                   lat: dict[str, dict[str, Any]]) -> str:
    """The docs/benchmarks.md section (heading included)."""
    lines = [f"## {SECTION}", "", "Regenerated by (do not edit by hand):", "", "    " + meta["command"], "",
             f"Run {meta['date']} on {meta['machine']}; load average before the run {meta['load_before']}, "
             f"after {meta['load_after']}. Peer: {meta['peer_version']}. {meta['config']}. "
             f"Code: {meta['tree']}.", ""]
    lines += ["**Who shares the 2 cores.** Everything runs on this one machine: the instances, every router "
              "(all started for the whole phase; only the measured one is busy), the load generator (this "
              "script, one process) and whatever else runs there (another engineer's benchmarks). The tables "
              "give the cores each used during the measured windows (medians over the rounds; `other` is the "
              "rest of the machine). A router's throughput here is bounded by the CPU the instances and the "
              "load generator leave it.", ""]
    for fleet, rows in sat.items():
        lines += [f"### (a) Saturation throughput: {meta['fleets'][fleet]}", "",
                  f"Closed loop, {meta['connections']} keep-alive connections, chat completions of ≈"
                  f"{meta['prompt_chars']} characters, max_tokens {meta['max_tokens']}, every other one streamed; "
                  f"{meta['rounds']} rounds × {meta['duration']:g} s per contender (after {meta['warmup']:g} s "
                  "unmeasured), ABBA order. req/s: median over the rounds (every round in brackets); "
                  "× smg: median of the rounds' ratios. The other work on the machine comes and goes within "
                  "seconds, so a router's req/s depends on how much of it fell into its windows; the CPU a "
                  "router spends per request (its cores ÷ its req/s, medians) does not, and req/s per router "
                  "core (× smg's) is the comparison to trust when the `other` column differs between rows.", "",
                  "| contender | req/s (rounds) | × smg | errors | latency p50 / p99 | cores: router / instances / "
                  "load gen / other | router CPU per request | req/s per router core |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for label, s in rows.items():
            c = s["cores"]
            router = c.get(label) if label != "direct" else None
            cpu_us = s["router_cpu_us_per_request"]
            lines.append(
                f"| {label} | {s['rps']:,.0f} ({', '.join(f'{x:,.0f}' for x in s['rounds'])}) | "
                f"{number(s['ratio_to_peer'])} | {s['errors']} | {number(s['latency_p50_ms'], 1)} / "
                f"{number(s['latency_p99_ms'], 1)} ms | {number(router)} / {number(c.get('instances'))} / "
                f"{number(c.get('load generator'))} / {number(c.get('other processes'))} | "
                f"{us(cpu_us)} | {'-' if not cpu_us else f'{1e6 / cpu_us:,.0f}'}{times(s['per_core_ratio_to_peer'])} |")
        lines += ["", loadgen_note(rows), ""]
    if lat:
        lines += [f"### (b) Added latency at {meta['streams']} concurrent streams", "",
                  f"{meta['latency_fleet']}; {meta['streams']} sessions, each sending the same streamed request "
                  f"({meta['stream_tokens']} tokens) at the same moment straight to an instance and through the "
                  "router, then the next; TTFT = request written → first body byte (the first SSE event). "
                  f"{meta['rounds']} rounds × {meta['duration']:g} s per router, ABBA order; pairs pooled over the "
                  "rounds. Added = router percentile − direct percentile (the target); paired = percentile of "
                  "the per-pair differences.", "",
                  "| router | pairs | errors | direct TTFT p50 / p99 | routed TTFT p50 / p99 | **added p50 / p99** | "
                  "paired diff p50 / p99 | added p50 per round | added p99 per round | cores: router / machine |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for label, s in lat.items():
            lines.append(
                f"| {label} | {s['pairs']:,} | {s['errors']} | {number(s['direct_p50'])} / {number(s['direct_p99'])} ms | "
                f"{number(s['router_p50'])} / {number(s['router_p99'])} ms | **{number(s['added_p50'])} / "
                f"{number(s['added_p99'])} ms** | {number(s['paired_p50'])} / {number(s['paired_p99'])} ms | "
                f"{', '.join(number(x) for x in s['rounds_added_p50'])} | "
                f"{', '.join(number(x) for x in s['rounds_added_p99'])} | {number(s['router_cores'])} / "
                f"{number(s['machine_cores'])} |")
        lines.append("")
    lines += ["### Targets", ""] + [f"- {v}" for v in verdicts(sat, lat)]
    if meta.get("notes"):
        lines += ["", "Not measured:", ""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


def loadgen_note(rows: dict[str, dict[str, Any]]) -> str:
    """Whether the load generator could have been the bottleneck, from the cores it used."""
    routed = {k: v for k, v in rows.items() if k != "direct"}
    parts = []
    if routed:
        worst = max(routed.values(), key=lambda v: v["cores"].get("load generator", 0.0))
        parts.append(f"Load generator: at most {worst['cores'].get('load generator', 0.0):.2f} cores in a router's "
                     f"windows ({us(worst['loadgen_cpu_us_per_request'])} per request), far from one core: the "
                     "routers, not it, set their throughput.")
    if "direct" in rows:
        d = rows["direct"]["cores"]
        parts.append(f"`direct` ({d.get('load generator', 0.0):.2f} cores load generator, "
                     f"{d.get('instances', 0.0):.2f} instances) is bounded by the CPU they share, not by a router: "
                     "it shows how far the instances are from limiting the routers.")
    return " ".join(parts)


def verdicts(sat: dict[str, dict[str, dict[str, Any]]], lat: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for fleet, rows in sat.items():
        peer = rows.get(PEER)
        for label in ("warmroute", "warmroute x2"):
            s = rows.get(label)
            if s is None or peer is None or s["ratio_to_peer"] is None:
                continue
            met = s["ratio_to_peer"] >= 1.0
            per_core = ("" if s["per_core_ratio_to_peer"] is None
                        else f" (per router core {s['per_core_ratio_to_peer']:.2f}×)")
            out.append(f"(a) {fleet} fleet, {label}: {s['rps']:,.0f} vs smg {peer['rps']:,.0f} req/s, "
                       f"{s['ratio_to_peer']:.2f}×{per_core} — **{'met' if met else 'missed'}**")
    for label, s in lat.items():
        met = latency_met(s)
        if met is None:
            continue
        out.append(f"(b) {label}: adds {s['added_p50']:.2f} ms at p50 (≤ {TARGET_P50_MS:g}) and "
                   f"{s['added_p99']:.2f} ms at p99 (≤ {TARGET_P99_MS:g}) — **{'met' if met else 'missed'}**")
    return out or ["nothing measured"]


def summary_rows(sat: dict[str, dict[str, dict[str, Any]]], lat: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The two rows of the summary table, keyed by their first cell's start."""
    rows = {}
    if sat:
        parts, best_ratio = [], []
        for fleet, r in sat.items():
            peer = r.get(PEER)
            if peer is None:
                continue
            ours = {k: r[k] for k in ("warmroute", "warmroute x2") if k in r and r[k]["ratio_to_peer"] is not None}
            if not ours:
                continue
            best_ratio.append(max(v["ratio_to_peer"] for v in ours.values()))
            cpu = (f", router CPU per request {us(ours['warmroute']['router_cpu_us_per_request'])} vs "
                   f"{us(peer['router_cpu_us_per_request'])} "
                   f"({ours['warmroute']['per_core_ratio_to_peer']:.2f}× smg's req/s per core)"
                   if "warmroute" in ours and ours["warmroute"]["per_core_ratio_to_peer"] else "")
            parts.append(f"{fleet} instances: smg {peer['rps']:,.0f} req/s; " + ", ".join(
                f"{k} {v['rps']:,.0f} ({v['ratio_to_peer']:.2f}×)" for k, v in ours.items()) + cpu)
        if parts:
            status = "met" if min(best_ratio) >= 1 else ("missed" if max(best_ratio) < 1 else "met on some fleets")
            rows["| saturation throughput"] = (
                "| saturation throughput with trivial instances ≥ SGLang Model Gateway's, same machine (#2) | "
                + "; ".join(parts) + "; routers, instances, load generator and other work share 2 cores "
                "([below](#saturation-throughput-and-added-latency-issue-2)) | " + status + " |")
    if lat:
        ours = lat.get("warmroute")
        if ours is not None and ours.get("added_p50") is not None:
            peer = lat.get(PEER)
            peer_txt = (f" (smg {peer['added_p50']:.2f} / {peer['added_p99']:.2f} ms)"
                        if peer and peer.get("added_p50") is not None else "")
            x2 = lat.get("warmroute x2")
            x2_txt = (f", 2 workers {x2['added_p50']:.2f} / {x2['added_p99']:.2f} ms"
                      if x2 and x2.get("added_p50") is not None else "")
            status = ("met for short prompts" if latency_met(ours) else
                      "met for short prompts with 2 workers" if x2 and latency_met(x2) else "missed")
            rows["| router added latency"] = (
                "| router added latency p50 ≤ 1 ms, p99 ≤ 3 ms at 64 streams (#2) | TTFT through the router minus "
                f"straight to the instance, 64 paced streams: p50 {ours['added_p50']:.2f} ms, p99 "
                f"{ours['added_p99']:.2f} ms{x2_txt}{peer_txt}; long Mooncake prompts (12–64k tokens): "
                "[peers.md](peers.md), column \"router adds\" | " + status + " |")
    return rows


def render_fragment(result: dict[str, Any]) -> str:
    """The docs/benchmarks.md section, then its rows for the summary table at the top of that page."""
    section = render_section(result["meta"], result["saturation"], result["latency"])
    rows = summary_rows(result["saturation"], result["latency"])
    if not rows:
        return section
    return section + "\n### Rows for the summary table\n\n" + "\n".join(rows.values()) + "\n"
