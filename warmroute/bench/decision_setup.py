"""The decision benchmarks' setup (benchmarks/decision_latency.py, decision_tail.py): a core's functions, a fleet
with a large prefix index, request bodies, percentiles, and fixed pure-Python work to read a machine's tail by."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from warmroute.core import block_hash, prefix_index, strategies
from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.routing_key import RoutingKey, key_for_json

SIZES = {"instances": 64, "prefixes": 100_000, "chars": 32_000, "samples": 2_000}  # the documented setup


def words(rng: random.Random, n_chars: int) -> str:
    vocab = ["cache", "router", "prefix", "token", "block", "fleet", "engine", "model", "latency", "policy"]
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(vocab)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def body(system: str, user: str) -> dict:
    return {"model": "llama", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=1000)[int(q * 10) - 1] if len(xs) > 1 else xs[0]


class Core:
    """The functions a request goes through, from one version of warmroute.core."""

    def __init__(self, label: str, hashes: Callable[..., list[int]], index_cls: type,
                 make_strategy: Callable[..., Any]) -> None:
        self.label, self.hashes, self.index_cls, self.make_strategy = label, hashes, index_cls, make_strategy

    def blocks(self, key: RoutingKey, block_bytes: int = 64) -> list[int]:
        # RoutingKey caches its block hashes per block size; seeding that cache makes the strategy use them.
        got = key._blocks[block_bytes] = self.hashes(key.source, key.seed, block_bytes)
        return got


def current_core() -> Core:
    return Core("now", block_hash.block_hashes, prefix_index.PrefixIndex, strategies.make_strategy)


def build_fleet(core: Core, args: argparse.Namespace) -> tuple[Fleet, str]:
    """`args.instances` instances and `args.prefixes` indexed prompts, plus one long system prompt (returned) of
    `args.chars` characters indexed on instance-7."""
    rng = random.Random(0)
    fleet = Fleet(FleetSettings())
    fleet.index = core.index_cls(fleet.index.max_entries)
    for i in range(args.instances):
        fleet.add(f"instance-{i}", kv_capacity_tokens=10**8)
    if args.engine_load:
        for inst in fleet.instances.values():
            fleet.engine_load(inst.name, waiting=rng.randint(0, 3), running=rng.randint(0, 8), kv_usage=0.3)
    t0 = time.perf_counter()
    for p in range(args.prefixes):  # 100k distinct ~600-character prompts spread over the fleet
        k = key_for_json("/v1/chat/completions", body(f"tenant {p} " + words(rng, 600), "hi"))
        fleet.index.record(f"instance-{p % args.instances}", core.blocks(k))
    print(f"[{core.label}] indexed {args.prefixes:,} prefixes ({fleet.index.entries():,} block entries, "
          f"≈{fleet.index.estimated_bytes() / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s")
    long_system = words(rng, args.chars - 200)
    fleet.index.record("instance-7", core.blocks(key_for_json("/v1/chat/completions", body(long_system, "warm-up"))))
    return fleet, long_system


def _fixed_work(n: int) -> int:
    s = 0
    for i in range(n):
        s += i * i
    return s


def timed_work(n: int) -> float:
    """µs taken by `n` steps of work that never varies."""
    t0 = time.perf_counter_ns()
    _fixed_work(n)
    return (time.perf_counter_ns() - t0) / 1000


def work_steps(target_us: float, probe: int = 2000) -> int:
    """Steps of fixed work taking about `target_us` (from the fastest of a few runs of a probe size)."""
    fastest = min(timed_work(probe) for _ in range(20))
    return max(1, int(probe * target_us / max(fastest, 1e-3)))
