#!/usr/bin/env python3
"""warmroute against the routers users already run, on the same emulated fleet, with the same traffic.

    .venv/bin/python benchmarks/compare_peers.py [--quick] [--workloads mixed hot ...] [--contenders ...]

Contenders: warmroute's `random`, `prefix` and `cache_aware` strategies; SGLang Model Gateway (`smg launch
--policy cache_aware`); vllm-router (`--policy cache_aware` and `--policy consistent_hash`). The peers are
installed from PyPI into their own virtualenv (.peers-venv/, git-ignored; never a dependency of warmroute);
a peer that cannot be installed or started is reported and skipped.

For every workload and every contender: a fresh emulated fleet (4 instances, cold caches, KV capacity sized
so the fleet holds less than the workload's working set), the router in front of it, identical traffic (same
workload, seed and load) through it with `warmroute.bench.run_bench`, then both stopped. Per-instance load
comes from the engines' own /metrics (the peers do not send warmroute's x-warmroute-instance header). The
latency a router adds is measured apart, on an instant fleet (`--time-scale 0`): the same requests sent
alternately straight to an engine and through the router, the median of the paired TTFT differences.

Workloads are offered as closed loops (N sessions, each sending its next request when the last one ends), as
traces on their own clock, or (`hot-open`) as an open loop at a fixed rate: in a closed loop a faster router
gets more requests, so its TTFTs are taken at a higher load than the others'; at a fixed rate all face the same.

Writes out/peers.md (the exact command line on top), out/peers.json (everything measured) and out/peers.png (TTFT
distribution per workload and contender, hit rate and throughput bars; needs matplotlib, `pip install
'warmroute[plot]'`); pass `--report docs/peers.md` to replace the published report (a trial run never overwrites it).
The figure again from a saved JSON, nothing run:

    .venv/bin/python benchmarks/compare_peers.py --plot-only out/peers.json --figure docs/img/peers.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from warmroute.bench.compare_peers import (CONTENDERS, MAX_TOKENS, PEERS_VENV, PeerInstall, RunOutcome, check_targets,
                                           ensure_peers, load_text, plans, progress_line, render_report,
                                           result_json, router_overhead, row_metrics, run_one, size)
from warmroute.bench.plot import require_matplotlib, write_peers_figure
from warmroute.bench.record import OUT, command_line, log, machine, now_utc, tree_state
from warmroute.errors import UsageError


# -- driver ---------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", metavar="NAME", help="subset of: mixed hot hot-open kv-pressure chat conversation synthetic")
    p.add_argument("--contenders", nargs="+", metavar="LABEL",
                   help="subset of: " + ", ".join(repr(c.label) for c in CONTENDERS))
    p.add_argument("--quick", action="store_true",
                   help="reduced configuration: 10 s windows, 60%% of the trace requests (for a shared machine)")
    p.add_argument("--duration", type=float, help="measured seconds per closed-loop run (default 15; --quick 10)")
    p.add_argument("--warmup", type=float, help="unmeasured seconds first (default 5; --quick 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help=f"output tokens per request, traces included (default {MAX_TOKENS}: see MAX_TOKENS)")
    p.add_argument("--overhead-pairs", type=int, default=40, help="request pairs per workload for router overhead")
    p.add_argument("--peers-venv", type=Path, default=PEERS_VENV, help="virtualenv for the peers")
    p.add_argument("--no-install", action="store_true", help="use the peers already in --peers-venv")
    p.add_argument("--report", type=Path, default=OUT / "peers.md",
                   help="where the Markdown report goes (docs/peers.md to replace the published one)")
    p.add_argument("--json", type=Path, default=OUT / "peers.json")
    p.add_argument("--figure", type=Path, help="where the PNG goes (default: beside the JSON, e.g. out/peers.png)")
    p.add_argument("--plot-only", type=Path, metavar="JSON",
                   help="run nothing: draw the figure of a saved out/peers.json (to --figure, or beside it)")
    p.add_argument("--logs", type=Path, help="keep every engine's and router's log in this folder")
    p.add_argument("--dry-run", action="store_true", help="print how each workload is sized and loaded, run nothing")
    args = p.parse_args(argv)
    args.figure = args.figure or (args.plot_only or args.json).with_suffix(".png")
    args.duration = args.duration or (10.0 if args.quick else 15.0)
    args.warmup = args.warmup if args.warmup is not None else (4.0 if args.quick else 5.0)
    return args


def plot_only(args: argparse.Namespace) -> int:
    """The figure of a saved JSON; nothing run."""
    require_matplotlib()
    try:
        data = json.loads(args.plot_only.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {args.plot_only}: {exc}") from None
    write_peers_figure(data, args.figure)
    log(f"wrote {args.figure}")
    return 0


def write_figure(data: dict[str, Any], path: Path) -> None:
    """The figure beside the JSON, if matplotlib is here: hours of measuring are never lost to a missing plot."""
    try:
        require_matplotlib()
    except UsageError as exc:
        log(f"no figure: {exc}")
        return
    write_peers_figure(data, path)
    log(f"wrote {path}")


async def compare(args: argparse.Namespace, argv: list[str]) -> int:
    all_plans = plans(args.quick)
    chosen = [p for p in all_plans if not args.workloads or p.label in args.workloads]
    contenders = [c for c in CONTENDERS if not args.contenders or c.label in args.contenders]
    if not chosen or not contenders:
        raise UsageError("no workload or contender selected (see --help for the names)")
    if args.dry_run:
        for p in chosen:
            w = p.build(args.seed, args.max_tokens)
            sz = size(p, w)
            print(f"{p.label}: {load_text(p, sz)}; working set {sz.working_set:,} tokens, largest request "
                  f"{sz.largest_request:,}, {sz.kv_capacity_tokens:,} KV tokens per instance "
                  f"(fleet/working set {sz.fleet_over_working_set:.2f}), time scale {p.time_scale:g}")
        return 0
    notes: list[str] = []
    peers = ensure_peers(args.peers_venv, not args.no_install, log) if any(c.is_peer for c in contenders) else {}
    for cmd, inst in peers.items():
        log(f"peer {cmd}: " + (f"ok, version {inst.version}" if inst.ok else f"UNAVAILABLE: {inst.note}"))
        if not inst.ok:
            notes.append(f"{cmd}: {inst.note}")
    contenders = [c for c in contenders if not c.is_peer or peers.get(c.router, PeerInstall(c.router, False)).ok]

    workloads = {p.label: p.build(args.seed, args.max_tokens) for p in chosen}
    sizings = {p.label: size(p, workloads[p.label]) for p in chosen}
    outcomes: list[RunOutcome] = []
    overheads: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="warmroute-peers-") as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for plan in chosen:
            sz = sizings[plan.label]
            log(f"== {plan.label}: {sz.kv_capacity_tokens:,} KV tokens per instance "
                f"(fleet/working set {sz.fleet_over_working_set:.2f}), {load_text(plan, sz)}")
            for c in contenders:
                o = await run_one(c, plan, workloads[plan.label], sz, args, logs)
                outcomes.append(o)
                log("   " + progress_line(o))
        for c in contenders:
            overheads[c.label] = await router_overhead(c, workloads, args, logs, args.overhead_pairs)
            log(f"   router overhead {c.label}: " + json.dumps(overheads[c.label]))
    log(f"done in {time.monotonic() - started:.0f} s")

    table: dict[str, dict[str, dict[str, float | None]]] = {}
    for o in outcomes:
        if o.summary is not None:
            table.setdefault(o.workload, {})[o.contender] = row_metrics(o, overheads.get(o.contender))
    peer_labels = [c.label for c in CONTENDERS if c.is_peer]
    targets = [t for p in chosen
               for t in check_targets(p.label, table.get(p.label, {}), peer_labels, fixed_rate=not p.closed_loop)]
    meta = {
        "command": command_line(__file__, argv),
        "date": now_utc(),
        "code": tree_state(),
        "machine": machine(),
        "config": ("reduced configuration (--quick)" if args.quick else "full configuration")
                  + f", {args.warmup:g} s warm-up + {args.duration:g} s measured per closed-loop run"
                  + "".join(f" ({p.label}: {args.duration * p.window_factor:g} s)" for p in chosen
                            if p.window_factor != 1.0),
        "peer_versions": ", ".join(f"{k} {v.version}" if v.ok else f"{k} unavailable" for k, v in peers.items())
                         or "not run",
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "contenders": [c.label for c in contenders],
        "peer_labels": peer_labels,
        "workloads": [{"label": p.label, "load": load_text(p, sizings[p.label]), "description": p.description,
                       "kv_capacity_tokens": sizings[p.label].kv_capacity_tokens, "time_scale": p.time_scale,
                       "working_set_tokens": sizings[p.label].working_set,
                       "largest_request_tokens": sizings[p.label].largest_request,
                       "fleet_over_working_set": sizings[p.label].fleet_over_working_set} for p in chosen],
        "notes": notes,
    }
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(render_report(meta, table, outcomes, targets))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    data = result_json(meta, table, overheads, targets, outcomes)
    args.json.write_text(json.dumps(data, indent=2))
    log(f"wrote {args.report} and {args.json}")
    write_figure(data, args.figure)
    print(args.report.read_text())
    return 0 if not any(o.error for o in outcomes) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the children on `kill` too
    try:
        if args.plot_only:
            return plot_only(args)
        return asyncio.run(compare(args, argv))
    except UsageError as exc:
        log(f"error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
