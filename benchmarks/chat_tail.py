#!/usr/bin/env python3
"""Where cache_aware's TTFT tail on long multi-turn chats comes from, and what shortening it costs (simulator).

    .venv/bin/python benchmarks/chat_tail.py [--seeds 8] [--requests 3000]

The case is the peer comparison's chat workload (docs/peers.md): 4 instances of 13,312 KV tokens, 8 running each,
32 closed-loop conversations of 6-12 turns with 300-token replies kept in the history. Its in-flight working set
is about the fleet's whole cache, so some conversations must lose their history.

Part 1, cache_aware alone, with every conversation sticky (sticky_kv_limit 1000, the rule before it existed) and
with sticky_kv_limit 1.75, both without holding in the router (hold_kv_limit 1000): each request's predicted
cached tokens (the router's index, at routing time) against what the engine found when it admitted the request,
bucketed by the chosen instance's KV pressure at routing time: (prompt tokens of the requests in flight there +
this request's predicted match) / its KV capacity. Under pressure the engine evicts a waiting conversation's
history to admit the requests ahead of it, so the index's prediction fails and the request both waits and
recomputes: those requests are the tail. sticky_kv_limit lets such a conversation go (its miss weighs as a shared
prefix's) where the pressure exceeds it; hold_kv_limit holds it in the router before it gets there.

Part 2, the trade-off: the shipped rule (sticky_kv_limit 1.75 and hold_kv_limit 1.4: a conversation kept on its
instance waits in the router while the prompts in flight there, with it, would need more than 1.4 x its KV cache,
and is decided again when a request finishes), the same without holding and with other hold limits,
sticky_kv_limit at several values, and variants that act on that pressure differently, over several seeds.
Except the hold rows, every variant runs without holding (hold_kv_limit 1000), as the rule was when it was tried.
The variants are experiments, not product code (they live only in this script), each a change of the rule as it
was before sticky_kv_limit (always sticky):
  * tighter load guard: ε 0.5, slack 0 instead of 1.0 and 4 (fewer conversations may pile onto one instance);
  * miss weight 4 for a private prefix instead of 16 (a conversation moves more readily);
  * survival discount: at an instance under pressure x (as in part 1), the part of its match that no other
    instance holds counts as cached only by a factor falling linearly from 1 at x = 1.25 to 0 at x = 1.75;
  * least_loaded, the SGLang-like reference and the oracle (cache_aware fed the engines' true caches), for scale.
and one change of the shipped rule:
  * count release: a conversation is also let go when its instance has at least k x the fleet's mean requests
    in flight (k 1.5 and 1.25), a signal from the request counts instead of the KV pressure.

Part 3: holding, sticky_kv_limit and the tighter guard on the other closed loops of the peer comparison (hot prompt,
mixed), where they must not cost what they buy on chat.
"""

from __future__ import annotations

import argparse
import statistics
from warmroute.core.fleet import Fleet
from warmroute.core.pipeline import Pipeline
from warmroute.core.stages import Handles
from warmroute.core.stages.prefix_match import PRIVATE, SWAMPED, PrefixMatch, index_depths, kv_pressure
from warmroute.core.strategies import (CACHE_AWARE, CacheAwareStrategy, Decision, Strategy, StrategySettings,
                                       make_strategy)
from warmroute.sim.report import summarize
from warmroute.sim.simulator import SimSettings, Simulation
from warmroute.workloads.registry import make_workload

CHAT = dict(min_turns=6, max_turns=12, reply_tokens=300, max_tokens=2)
BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)


def settings(seed: int, requests: int) -> SimSettings:
    return SimSettings(instances=4, requests=requests, concurrency=32, kv_capacity_tokens=13312, max_running=8,
                       seed=seed)


def pressure(fleet: Fleet, name: str, matched_tokens: int) -> float:
    """cache_aware's KV pressure at the instance (prompt tokens in flight there / its KV capacity; the simulator
    has no engine reports, so the router's books alone), plus this request's predicted match."""
    inst = fleet.instances[name]
    return kv_pressure(inst) + matched_tokens / inst.kv_capacity_tokens


# -- part 1 --------------------------------------------------------------------------------------------------
def prediction_by_pressure(seed: int, requests: int, name: str) -> None:
    sim = simulation(name, settings(seed, requests), make_workload("chat", seed=seed, **CHAT))
    choose, seen = sim.strategy.choose, []

    def observed(key, fleet):  # the decision and its instance's pressure, at routing time
        d = choose(key, fleet)
        seen.append((d, pressure(fleet, d.instance, d.matched_tokens)))
        return d

    sim.strategy.choose = observed
    result = sim.run()
    rows: dict[float, list] = {}
    for rec, (d, x) in zip(result.records, seen):
        if rec.first_token is None or d.matched_tokens <= 400:  # continuations (more than the system prompt)
            continue
        b = max([0.0, *[t for t in BUCKETS if x >= t]])
        rows.setdefault(b, []).append((d.matched_tokens, rec.cached_tokens, (rec.first_token - rec.arrival) * 1000))
    print(f"\nPart 1: {name}, seed {seed}, {requests} requests; continuations (predicted match > 400 tokens)")
    print(f"{'pressure':>10} {'requests':>8} {'predicted':>9} {'found':>7} {'found %':>7} {'TTFT p50':>8} "
          f"{'TTFT p90':>8}")
    for b in sorted(rows):
        r = rows[b]
        pred, found = sum(x[0] for x in r), sum(x[1] for x in r)
        t = sorted(x[2] for x in r)
        print(f"{'>= %.2f' % b:>10} {len(r):>8} {pred / len(r):>9.0f} {found / len(r):>7.0f} {found / pred:>7.0%} "
              f"{t[len(t) // 2]:>8.0f} {t[int(len(t) * 0.9)]:>8.0f}")


# -- part 2 --------------------------------------------------------------------------------------------------
NO_HOLD = dict(hold_kv_limit=1000.0)
ALWAYS = dict(sticky_kv_limit=1000.0, **NO_HOLD)
TUNED = {  # variant -> cache_aware's settings changed
    "no holding (hold_kv_limit 1000)": NO_HOLD,
    "hold_kv_limit 1.3": dict(hold_kv_limit=1.3),
    "hold_kv_limit 1.5": dict(hold_kv_limit=1.5),
    "always sticky (limit 1000)": ALWAYS,
    "sticky_kv_limit 2.0": dict(sticky_kv_limit=2.0, **NO_HOLD),
    "sticky_kv_limit 1.5": dict(sticky_kv_limit=1.5, **NO_HOLD),
    "tight guard (ε 0.5, slack 0)": dict(balance_factor=0.5, balance_slack=0, **ALWAYS),
    "miss weight 4 (private)": dict(miss_weight=4.0, **ALWAYS),
}
NO_HOLD_NAME, ALWAYS_NAME, TIGHT_NAME = "no holding (hold_kv_limit 1000)", "always sticky (limit 1000)", \
    "tight guard (ε 0.5, slack 0)"


SURVIVAL_LOW, SURVIVAL_HIGH = 1.25, 1.75


def survival_discounted(blocks, fleet: Fleet) -> dict[str, int]:
    """The index's depths, the unshared part of each holder's match discounted by the holder's KV pressure."""
    depths = index_depths(blocks, fleet)
    if not depths:
        return depths
    shared = sorted(depths.values())[-2] if len(depths) > 1 else 0  # what others hold too stays fresh
    out = {}
    for name, depth in depths.items():
        x = pressure(fleet, name, depth * fleet.block_tokens)
        keep = min(depth, shared)
        survives = min(1.0, max(0.0, (SURVIVAL_HIGH - x) / (SURVIVAL_HIGH - SURVIVAL_LOW)))
        out[name] = keep + round((depth - keep) * survives)
    return out


class SurvivalDiscount(Strategy):
    """cache_aware (always sticky) with survival-discounted depths; its decisions report the index's own
    prediction, as cache_aware's do."""

    def __init__(self, settings: StrategySettings) -> None:
        base = CACHE_AWARE.build("survival discount", settings, Handles(depths=survival_discounted))
        super().__init__(base.name, base.settings, base.pipeline, records_prefixes=True)

    def choose(self, key, fleet):
        d = super().choose(key, fleet)
        raw = fleet.index.match_depths(d.blocks).get(d.instance, 0) * fleet.block_tokens if d.blocks else 0
        return Decision(d.instance, d.reason, min(raw, d.prompt_tokens), d.prompt_tokens, d.blocks, d.private)

    decision = CacheAwareStrategy.decision


class CountRelease(PrefixMatch):
    """A conversation also let go where its instance has at least k x the fleet's mean requests in flight."""

    def __init__(self, base: PrefixMatch, k: float) -> None:
        super().__init__(base.miss_weight, base.shared_miss_weight, base.sticky_kv_limit, base.depths)
        self.k = k

    def miss_weight_for(self, req):
        alpha, held_by = super().miss_weight_for(req)
        if held_by != PRIVATE:  # not private, or already released
            return alpha, held_by
        holder = req.fleet.instances[max(req.depths, key=req.depths.__getitem__)]
        up = req.fleet.routable()
        if holder.inflight >= self.k * sum(i.inflight for i in up) / len(up):
            return self.shared_miss_weight, SWAMPED
        return alpha, held_by


def count_release(k: float, settings: StrategySettings) -> Strategy:
    s = make_strategy("cache_aware", settings)
    s.name = f"count release {k:g}x mean"
    p = s.pipeline
    facts = [CountRelease(f, k) if f.name == "prefix_match" else f for f in p.facts]
    s.pipeline = Pipeline(facts, p.filters, p.scorers, p.pickers)
    return s


def simulation(name: str, base: SimSettings, workload) -> Simulation:
    """The variant's simulation: its settings changed (the router's admission queue reads them too), and its
    strategy: a registered one by name, or an object built from those settings."""
    changes = TUNED.get(name) or (ALWAYS if name == "survival discount" else
                                  NO_HOLD if name.startswith("count release") else {})
    settings = base
    for setting, value in changes.items():
        settings = settings.changed(setting, value)
    strategy: str | Strategy = "cache_aware" if name in TUNED else name
    if name == "survival discount":
        strategy = SurvivalDiscount(settings.routing)
    elif name.startswith("count release"):
        strategy = count_release(float(name.split()[2].rstrip("x")), settings.routing)
    return Simulation(settings, workload, strategy)


VARIANTS = ["cache_aware", NO_HOLD_NAME, "hold_kv_limit 1.3", "hold_kv_limit 1.5", ALWAYS_NAME, "sticky_kv_limit 2.0",
            "sticky_kv_limit 1.5", TIGHT_NAME, "miss weight 4 (private)", "survival discount",
            "count release 1.5x mean", "count release 1.25x mean", "least_loaded", "sglang_like", "oracle"]


def trade_off(seeds: int, requests: int) -> None:
    print(f"\nPart 2: {seeds} seeds x {requests} requests, means")
    print(f"{'variant':<30} {'hit rate':>8} {'TTFT p50':>8} {'TTFT p99':>8} {'req/s':>6} {'spread':>6}")
    for name in VARIANTS:
        rows = []
        for seed in range(seeds):
            sim = simulation(name, settings(seed, requests), make_workload("chat", seed=seed, **CHAT))
            s = summarize(sim.run())
            rows.append((s.hit_rate, s.ttft_p50_ms, s.ttft_p99_ms, s.throughput_rps, s.load_spread))
        m = [statistics.mean(c) for c in zip(*rows)]
        print(f"{name:<30} {m[0]:>8.1%} {m[1]:>8.0f} {m[2]:>8.0f} {m[3]:>6.2f} {m[4]:>6.2f}", flush=True)


OTHERS = [
    ("hot, 16 clients", "hot", dict(requests=2000, concurrency=16, kv_capacity_tokens=10240, max_running=8),
     dict(hot=0.6, max_tokens=2)),
    ("mixed, 16 clients", "mixed", dict(requests=3000, concurrency=16, kv_capacity_tokens=16384, max_running=8),
     dict(max_tokens=2)),
]


def other_workloads(seeds: int) -> None:
    print(f"\nPart 3: {seeds} seeds, means")
    print(f"{'case':<18} {'variant':<30} {'hit rate':>8} {'TTFT p50':>8} {'TTFT p99':>8} {'req/s':>6}")
    for label, workload, sim_settings, params in OTHERS:
        for name in ("cache_aware", NO_HOLD_NAME, ALWAYS_NAME, TIGHT_NAME):
            rows = []
            for seed in range(seeds):
                sim = simulation(name, SimSettings(instances=4, seed=seed, **sim_settings),
                                 make_workload(workload, seed=seed, **params))
                s = summarize(sim.run())
                rows.append((s.hit_rate, s.ttft_p50_ms, s.ttft_p99_ms, s.throughput_rps))
            m = [statistics.mean(c) for c in zip(*rows)]
            print(f"{label:<18} {name:<30} {m[0]:>8.1%} {m[1]:>8.0f} {m[2]:>8.0f} {m[3]:>6.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3000)
    args = ap.parse_args()
    for name in (ALWAYS_NAME, NO_HOLD_NAME):  # without holding: each choice is one dispatch
        prediction_by_pressure(0, args.requests, name)
    trade_off(args.seeds, args.requests)
    other_workloads(args.seeds)


if __name__ == "__main__":
    main()
