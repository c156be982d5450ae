#!/usr/bin/env python3
"""Routing decision latency of the pure core: 64 instances, 100,000 indexed prefixes, 32,000-character prompts.

    .venv/bin/python benchmarks/decision_latency.py [--instances 64] [--prefixes 100000] [--chars 32000]
        [--samples 2000] [--engine-load] [--baseline GITREV]

Times, per request (its JSON body parsed just before, untimed, as the server does): building the routing key from
the parsed body, hashing its blocks, the strategy's choice
(index lookups + cost), and recording the chosen instance's blocks in the index. Where the C block hash is built,
the "block hashes" stage makes a lazy Chain, whose hashes are computed when first read: by the choice's index
lookup for a prompt whose first block is indexed, by the record for a cold one (the server records after the
request has been sent), so their cost shows in those stages. Prints p50/p99 in µs of every
stage, of the decision (key + block hashes + choose, summed per request before taking percentiles; `prefix`
needs no block hashes, so its decision is key + choose) and of the total with the record, for a warm prompt
(its prefix is indexed) and a cold one, for cache_aware and prefix.

The last row times fixed pure-Python work of about a decision's length as often: the p99 this machine gives
work that never varies (scheduling, other tenants), to read the p99s above against.

--engine-load gives every instance a scraped engine load (the cost model's engine terms then run for all).
--baseline GITREV also runs the core modules (block_hash, rendezvous, block_cache, prefix_index, strategies) as
they are at that git revision (a revision before the pipeline runs its cost scan in Python: the compiled one
has another interface now; compare such revisions from their own checkouts instead), on a second fleet and index built the same way, in turns of 50 requests with
the working tree's (the same requests), so that both see the same machine load; the table then shows both and
their ratio (baseline / now).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

from warmroute.bench.decision_setup import (SIZES, Core, body, build_fleet, current_core, pct, timed_work, words,
                                           work_steps)
from warmroute.core import rendezvous
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.stages import compiled
from warmroute.core.routing_key import key_for_json

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("key (parse to bytes)", "block hashes", "choose", "record in index")
# With --baseline, requests per turn of each core (per request, each would evict the other's caches). A turn's
# first request finds the caches as the other core left them, so turns are long enough that those requests are
# too few to set the p99 (docs/tuning.md).
CHUNK = 250


def baseline_core(rev: str) -> Core:
    """The core modules as they are at `rev`, loaded beside the working tree's."""
    mods: dict[str, types.ModuleType] = {}
    for name in ("block_hash", "rendezvous", "block_cache", "prefix_index", "strategies"):
        src = subprocess.run(["git", "show", f"{rev}:warmroute/core/{name}.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        mod = mods[name] = types.ModuleType(f"baseline_{name}")
        sys.modules[mod.__name__] = mod  # dataclasses look their module up
        exec(compile(src, f"{rev}:warmroute/core/{name}.py", "exec"), mod.__dict__)
    # Their imports of each other found the working tree's modules: point them at the baseline's.
    mods["prefix_index"].BlockCache = mods["block_cache"].BlockCache
    mods["strategies"].rendezvous = mods["rendezvous"]
    # The compiled extensions are the working tree's builds, shared with it: the baseline's strategies just
    # configured the one _scan module with its own rendezvous; configure it again as the working tree does (so
    # the baseline's ties are weighed by this tree's code too).
    if compiled._scan is not None:
        compiled._scan.configure(Instance, rendezvous.hash_fn, rendezvous.name_bytes, rendezvous.encoded,
                                 rendezvous.hash_fn_address())
        old = mods["strategies"]
        if hasattr(old, "scan_python"):  # a revision before the pipeline: its scan's interface is not this _scan's
            old.scan = old.scan_python
    hashes = mods["block_hash"].block_hashes
    if not hasattr(mods["prefix_index"], "CompiledPrefixIndex"):  # its index wants the hashes as a list of ints
        def hashes(data: bytes, seed: int = 0, block_bytes: int = 64, _h=hashes) -> list[int]:
            got = _h(data, seed, block_bytes)
            return got if isinstance(got, list) else got.tolist()
    return Core(rev, hashes, mods["prefix_index"].PrefixIndex, mods["strategies"].make_strategy)


def one_request(core: Core, strategy: Any, fleet: Fleet, raw: bytes) -> list[float]:
    """Stage times in µs (block hashes 0 where the strategy needs none). The body is parsed just before, untimed,
    as the server parses it just before routing: its strings are as fresh in the CPU caches as there."""
    b = json.loads(raw)
    t0 = time.perf_counter_ns()
    key = key_for_json("/v1/chat/completions", b)
    t1 = time.perf_counter_ns()
    if strategy.records_prefixes:
        core.blocks(key)
    t2 = time.perf_counter_ns()
    d = strategy.choose(key, fleet)
    t3 = time.perf_counter_ns()
    if strategy.records_prefixes:
        fleet.index.record(d.instance, d.blocks)
    t4 = time.perf_counter_ns()
    return [(t1 - t0) / 1000, (t2 - t1) / 1000, (t3 - t2) / 1000, (t4 - t3) / 1000]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in SIZES.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--engine-load", action="store_true", help="every instance reports its own load")
    ap.add_argument("--baseline", metavar="GITREV", help="also time the core at this git revision")
    args = ap.parse_args()

    cores = [current_core()] + ([baseline_core(args.baseline)] if args.baseline else [])
    fleets = [build_fleet(c, args) for c in cores]
    long_system = fleets[0][1]
    rng = random.Random(1)

    head = f"{'strategy':<12} {'prompt':<5} {'stage':<34} {'p50 µs':>8} {'p99 µs':>8}"
    if args.baseline:
        head += f" {'base p50':>9} {'base p99':>9} {'p50 ×':>6} {'p99 ×':>6}"
    print(head)
    for name in ("cache_aware", "prefix"):
        strats = [c.make_strategy(name) for c in cores]
        for label in ("warm", "cold"):
            times: list[list[list[float]]] = [[] for _ in cores]  # core -> request -> stage
            # Every body built before any is timed: building them between turns evicted the caches too.
            raws = [json.dumps(body(long_system if label == "warm" else f"{n} " + long_system,
                                    f"question {n} " + words(rng, 150))).encode() for n in range(args.samples)]
            for start in range(0, args.samples, CHUNK):
                chunk = raws[start:start + CHUNK]
                order = range(len(cores)) if start // CHUNK % 2 else reversed(range(len(cores)))
                for c in order:  # the same requests, in turns, so that both see the same machine load
                    times[c] += [one_request(cores[c], strats[c], fleets[c][0], b) for b in chunk]
            hashes = strats[0].records_prefixes
            rows = {stage: [[t[s] for t in ts] for ts in times] for s, stage in enumerate(STAGES)}
            if not hashes:
                del rows["block hashes"], rows["record in index"]
            decision = "decision (key + hashes + choose)" if hashes else "decision (key + choose)"
            rows[decision] = [[t[0] + t[1] + t[2] for t in ts] for ts in times]
            rows["total (decision + record)"] = [[sum(t) for t in ts] for ts in times]
            for stage, per_core in rows.items():
                line = f"{name:<12} {label:<5} {stage:<34} {pct(per_core[0], 50):8.1f} {pct(per_core[0], 99):8.1f}"
                if args.baseline:
                    b50, b99 = pct(per_core[1], 50), pct(per_core[1], 99)
                    line += (f" {b50:9.1f} {b99:9.1f} {b50 / max(pct(per_core[0], 50), 1e-9):6.2f}"
                             f" {b99 / max(pct(per_core[0], 99), 1e-9):6.2f}")
                print(line, flush=True)
    noise_floor(args.samples)


def noise_floor(samples: int, target_us: float = 18.0) -> None:
    """The machine's own tail: the same pure-Python work, about as long as a decision, timed as often. Its p99
    over its p50 is what this machine adds to any p99 here (on a quiet dedicated core it would be ~1.0)."""
    n = work_steps(target_us)
    times = [timed_work(n) for _ in range(samples)]
    print(f"{'noise floor':<12} {'-':<5} {'fixed work, same length every time':<34} {pct(times, 50):8.1f} "
          f"{pct(times, 99):8.1f}", flush=True)


if __name__ == "__main__":
    main()
