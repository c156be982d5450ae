"""Disaggregated prefill/decode against aggregated serving, in the simulator, at equal instance count.

Two workloads: long shared prompts with long answers (documents, agents' contexts), and short chats. Fleets of
8 engines: aggregated; 4 prefill + 4 decode; 2 prefill + 6 decode (1:3); each split fleet with the router's
default threshold (pd_threshold_tokens) and with none (every request split). Prints one table per workload:
time to first token, time per output token after it (decode speed, where a prefill sharing the engine stalls
the batch), output throughput, the share of requests split, TTFT p50 against aggregated serving and against
the same split fleet with every request sent whole to its decode pool (the decision's own effect).

    .venv/bin/python benchmarks/disaggregation.py [--requests N] [--seed S]
"""

from __future__ import annotations

import argparse
import time

from warmroute.bench.stats import percentile
from warmroute.core.disaggregation import DisaggregationSettings
from warmroute.sim.report import fmt, summarize
from warmroute.sim.simulator import SimSettings, Simulation
from warmroute.workloads.registry import make_workload

WORKLOADS = {
    "long shared prompts, long answers": ("shared", {"system_tokens": 6000, "pool_size": 200, "max_tokens": 400}, 5.0),
    "short chats": ("chat", {"max_tokens": 120}, 4.0),
}
NEVER = DisaggregationSettings(pd_threshold_tokens=10_000_000)  # every request whole to a decode instance
FLEETS = [("aggregated 8", 0, None)] + [
    (f"{p}P+{8 - p}D, {what}", p, pd) for p in (4, 2)
    for what, pd in (("never split", NEVER), ("default threshold", DisaggregationSettings()),
                     ("threshold 0", DisaggregationSettings(pd_threshold_tokens=0)))]


def row(name: str, settings: SimSettings, workload: str, params: dict, seed: int) -> dict:
    start = time.perf_counter()
    result = Simulation(settings, make_workload(workload, seed=seed, **params), "cache_aware").run()
    s = summarize(result)
    prefill = [r for r in result.records if r.prefill_instance]
    asked = sum(r.prompt_tokens for r in prefill)
    return {"fleet": name, "ttft_p50": s.ttft_p50_ms, "ttft_p99": s.ttft_p99_ms, "tpot_p50": s.tpot_p50_ms,
            "tpot_p99": s.tpot_p99_ms, "tok_s": s.output_tokens_per_s, "split": s.split, "hit": s.hit_rate,
            "prefill_hit": sum(r.prefill_cached_tokens for r in prefill) / asked if asked else None,
            "e2e_p50": percentile([r.done - r.arrival for r in result.records if r.done is not None], 50),
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for title, (workload, params, rate) in WORKLOADS.items():
        print(f"\n### {title} ({workload} {params}, {rate} sessions/s, {args.requests} requests, seed {args.seed})\n")
        print("| fleet | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | output tok/s | split | "
              "prefill-leg hit | TTFT p50 vs aggregated | vs never split |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        base = never = None
        for name, prefill, pd in FLEETS:
            settings = SimSettings(instances=8, requests=args.requests, rate=rate, seed=args.seed,
                                   prefill_instances=prefill, pd=pd or DisaggregationSettings())
            r = row(name, settings, workload, params, args.seed)
            base = base if base is not None else r["ttft_p50"]
            never = r["ttft_p50"] if pd is NEVER else never
            ratio = r["ttft_p50"] / base if base and r["ttft_p50"] is not None else None
            own = r["ttft_p50"] / never if prefill and never and r["ttft_p50"] is not None else None
            print(f"| {name} | {fmt(r['ttft_p50'], '.0f')} | {fmt(r['ttft_p99'], '.0f')} | "
                  f"{fmt(r['tpot_p50'], '.1f')} | {fmt(r['tpot_p99'], '.1f')} | {r['tok_s']:.0f} | "
                  f"{r['split']:.0%} | {fmt(r['prefill_hit'], '.1%')} | {fmt(ratio, '.2f')}x | {fmt(own, '.2f')}x |",
                  flush=True)


if __name__ == "__main__":
    main()
