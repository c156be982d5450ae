#!/usr/bin/env python3
"""Saturation throughput and added latency of the router on trivial instances, beside SGLang Model Gateway.

    .venv/bin/python benchmarks/saturation.py [--quick] [--rounds N] [--duration S] [--fleets stub engine]
                                              [--contenders direct warmroute "warmroute x2" smg]
                                              [--phases saturation latency] [--no-doc]

Issue #2's two performance targets, measured side by side in one run on one machine:

(a) Saturation throughput: a closed loop of many keep-alive connections (`--connections`, default 128), each
    sending small chat completions back to back (short prompts: one of 8 system prompts of 263 characters
    plus a question; `max_tokens` 8; every other request streamed), for a fixed window. Contenders: `direct`
    (the connections spread straight over the instances: the bound no router can beat), warmroute
    (`warmroute serve --strategy cache_aware`, one worker and `--workers 2`) and SGLang Model Gateway
    (`smg launch --policy cache_aware`). All routers run for the whole phase in front of the same fleet;
    each round measures every contender once, the order reversed every other round (ABBA), so a change in
    the machine's other load falls on all of them alike. Ratios to smg are taken within a round.
    Fleets (`--fleets`): `stub`, trivial instances that answer with prebuilt bytes
    (`warmroute.bench.trivial`), and `engine`, the emulated engine at `--time-scale 0` (an instant fleet
    whose Python costs ≈ 0.25 ms per request: it saturates before a fast router does).

(b) Added latency at 64 concurrent streams: 64 sessions (`--streams`), each sending the same streamed
    request at the same moment straight to an instance and through the router (which of the two is written
    first alternates), waiting for both to end, and repeating. The instances are trivial ones that write the
    first token at once and each further token `--itl-ms` (20) later, for 32 tokens, so the router relays 64
    live streams at a decoding engine's pace (≈ 3,200 chunks/s) without saturating the machine itself.
    TTFT = time from writing the request to the first body byte of the answer (the first SSE event).
    Reported: p50 and p99 of both TTFT distributions and their differences (the target), and percentiles of
    the paired differences.

The load generator (`warmroute.bench.rawload`, asyncio protocols on uvloop): 20–80 µs of CPU per request
(the more requests per wake-up, the less), measured and reported per window beside the router's and the
instances' CPU, so it can be seen not to be the bottleneck (wrk or h2load are not needed; neither is
installed here). The peers come from .peers-venv/ (see benchmarks/compare_peers.py; `--install` installs
them there if missing); a peer that is missing or does not start is reported and skipped.

Writes out/saturation.json (everything measured) and out/saturation.md: the section "Saturation throughput
and added latency (issue #2)" of docs/benchmarks.md and its two rows for the summary table at the top, to be
pasted there by hand.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from warmroute.bench import compare_peers as cp
from warmroute.bench.record import OUT, command_line, load_average, log, machine, now_utc, tree_state, write_outputs
from warmroute.bench.saturation import (CONTENDERS, INSTANCES, SYSTEM_PROMPTS, FleetSpec, latency_by_contender,
                                        phase_latency, phase_saturation, render_fragment, saturation_summary)
from warmroute.errors import UsageError


# -- driver ---------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    labels = [c.label for c in CONTENDERS]
    p.add_argument("--contenders", nargs="+", metavar="LABEL", default=labels, help="subset of: " + ", ".join(
        repr(x) for x in labels))
    p.add_argument("--fleets", nargs="+", choices=["stub", "engine"], default=["stub", "engine"],
                   help="instances for (a): trivial stubs and/or the emulated engine at time scale 0")
    p.add_argument("--engine-processes", type=int, default=2, help="processes the emulated fleet is split over")
    p.add_argument("--phases", nargs="+", choices=["saturation", "latency"], default=["saturation", "latency"],
                   help="(a), (b) or both (the default)")
    p.add_argument("--quick", action="store_true", help="2 rounds of 4 s (instead of 5 of 5)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--duration", type=float, help="measured seconds per window")
    p.add_argument("--warmup", type=float, default=1.5, help="unmeasured seconds before each window")
    p.add_argument("--connections", type=int, default=128, help="(a) keep-alive connections")
    p.add_argument("--max-tokens", type=int, default=8, help="(a) max_tokens per request")
    p.add_argument("--streams", type=int, default=64, help="(b) concurrent streams through the router")
    p.add_argument("--latency-instances", type=int, default=INSTANCES,
                   help="(b) trivial instances the streams share (1: one engine taking every stream)")
    p.add_argument("--stream-tokens", type=int, default=32, help="(b) tokens per stream")
    p.add_argument("--itl-ms", type=float, default=20.0, help="(b) milliseconds between two streamed tokens")
    p.add_argument("--peers-venv", type=Path, default=cp.PEERS_VENV)
    p.add_argument("--install", action="store_true", help="pip-install a missing peer into --peers-venv")
    p.add_argument("--json", type=Path, default=OUT / "saturation.json",
                   help="everything measured; the Markdown fragment goes beside it (.md)")
    p.add_argument("--logs", type=Path, help="keep every child's log in this folder")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.duration = args.duration or (4.0 if args.quick else 5.0)
    unknown = set(args.contenders) - set(labels)
    if unknown:
        p.error(f"unknown contenders: {', '.join(sorted(unknown))}")
    return args


async def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Both phases; returns everything measured (what out/saturation.json holds)."""
    contenders = [c for c in CONTENDERS if c.label in args.contenders]
    notes: list[str] = []
    peer_version = "not run"
    if any(c.is_peer for c in contenders):
        peers = cp.ensure_peers(args.peers_venv, args.install, log)
        smg = peers.get("smg")
        if smg is None or not smg.ok:
            notes.append(f"smg: {smg.note if smg else 'not installed'}")
            contenders = [c for c in contenders if not c.is_peer]
            peer_version = "smg unavailable"
        else:
            peer_version = f"smg {smg.version}"
    load_before = load_average()
    started = time.monotonic()
    sat_windows: dict[str, list[dict[str, Any]]] = {}
    lat_windows: list[dict[str, Any]] = []
    fleets = {k: FleetSpec(k, processes=args.engine_processes if k == "engine" else 1) for k in args.fleets}
    latency_fleet = ""
    with tempfile.TemporaryDirectory(prefix="warmroute-saturation-") as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        if "saturation" in args.phases:
            for kind, fleet in fleets.items():
                sat_windows[kind], more = await phase_saturation(fleet, contenders, args, logs)
                notes += more
        if "latency" in args.phases and any(c.router for c in contenders):
            lat_windows, more, lfleet = await phase_latency(contenders, args, logs)
            latency_fleet = lfleet.describe()
            notes += more
    log(f"done in {time.monotonic() - started:.0f} s")
    return {
        "meta": {
            "command": command_line(__file__, argv),
            "tree": tree_state(),
            "date": now_utc(),
            "machine": machine(),
            "load_before": load_before, "load_after": load_average(),
            "peer_version": peer_version,
            "config": f"{args.rounds} rounds, {args.warmup:g} s warm-up + {args.duration:g} s measured per window",
            "rounds": args.rounds, "duration": args.duration, "warmup": args.warmup,
            "connections": args.connections, "max_tokens": args.max_tokens,
            "prompt_chars": len(SYSTEM_PROMPTS[0]) + 30,  # system prompt + question
            "streams": args.streams, "stream_tokens": args.stream_tokens, "itl_ms": args.itl_ms,
            "fleets": {k: f.describe() for k, f in fleets.items() if k in sat_windows},
            "latency_fleet": latency_fleet,
            "notes": notes,
        },
        "saturation": {k: saturation_summary(v) for k, v in sat_windows.items()},
        "latency": latency_by_contender(lat_windows),
        "windows": {"saturation": sat_windows, "latency": [{k: v for k, v in w.items() if k != "pairs"}
                                                           | {"pairs": len(w["pairs"])} for w in lat_windows]},
    }


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        import uvloop
        result = uvloop.run(measure(args, argv))
    except UsageError as exc:
        log(f"error: {exc}")
        return 2
    fragment = render_fragment(result)
    print(fragment)
    write_outputs(args.json, result, fragment)
    bad = any(s["errors"] for rows in result["saturation"].values() for s in rows.values()) or any(
        s["errors"] for s in result["latency"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
