#!/usr/bin/env python3
"""Autoscaling in the simulator (issue #23): the demand signal against busy-time utilisation, cache-aware
scale-in against arbitrary, over a ramp-and-burst workload and the Mooncake conversation trace at changing speed.

For each workload, each signal is swept over its target (scale-in cache_aware), and each signal's cheapest
target whose TTFT p99 meets the SLO in >= 95% of the windows is its operating point: the same SLO attainment
bar for both, each at its best cost (a signal none of whose targets reaches it is reported so, with its best
attainment). Then the demand signal's operating point is run with arbitrary (random) and newest-first scale-in:
the hit rate lost in the minute after each scale-in, against cache_aware's. The autoscaled runs scale in at
different moments under different loads (their before/after difference is mostly the load changing), so the
scale-in policies are also compared on equal terms (`--scale-in-only` for that alone): a steady load, at a
given moment every instance drained in a run of its own, the hit rate of the minute after against the same
minute of the run without a drain. Arbitrary scale-in loses the mean over the instances (the expectation of a
random pick); cache_aware what its pick (the lowest cache value) lost.

    .venv/bin/python benchmarks/autoscale.py [--workloads ramp-burst,mooncake] [--trace FILE]

`--value-oracle` instead checks how well cache value variants foresee what a drain would cost (ValueOracle).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np

from warmroute.core.cache_value import CacheValue, scale_in_victim, sole_lead
from warmroute.sim.autoscale import ARBITRARY, CACHE_AWARE, DEMAND, NEWEST, UTILIZATION, AutoscaleSettings
from warmroute.sim.report import (HIT_LOSS_WINDOW_S, AutoscaleSummary, autoscale_summary, autoscale_table,
                                  slo_text)
from warmroute.sim.simulator import SimResult, Simulation, SimSettings
from warmroute.workloads.base import Workload
from warmroute.workloads.rate_shape import RateShape, ramp_and_burst
from warmroute.workloads.registry import make_workload

TRACE = "../shared/data/mooncake/conversation_trace.jsonl"  # from the repository root, as the other docs
UTILIZATION_TARGETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9)
DEMAND_TARGETS = (0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7)
ATTAINMENT = 0.95  # the acceptance's bar: the SLO met in at least this share of the windows


@dataclass
class Case:
    label: str
    workload: Workload
    settings: SimSettings
    slo: dict = field(default_factory=dict)
    steady_instances: int = 8  # the fleet the scale-in comparison starts from


def case(name: str, trace: str, seed: int = 1, trace_start_s: float = 0.0) -> Case:
    shape = ramp_and_burst()
    if name == "ramp-burst":
        return Case("mixed workload, 128 output tokens, 12 sessions/s at peak x ramp-burst (x2 burst)",
                    make_workload("mixed", seed=seed, max_tokens=128),
                    SimSettings(instances=2, requests=10**9, rate=12.0, rate_shape=shape, seed=seed),
                    slo=dict(slo_ttft_s=1.0))
    if name == "mooncake":
        return Case(f"Mooncake conversation trace from {trace_start_s:g} s, x1 speed at peak x ramp-burst (x2 burst)",
                    make_workload("trace", seed=seed, path=trace, start_s=trace_start_s),
                    SimSettings(instances=6, requests=10**9, speedup=1.0, rate_shape=shape, seed=seed),
                    slo=dict(slo_ttft_s=10.0, slo_tokens_per_s=4000.0), steady_instances=16)
    raise SystemExit(f"unknown workload {name!r}: ramp-burst or mooncake")


STEADY_SCALE_INS = (300.0, 360.0, 420.0, 480.0)


class Drain(Simulation):
    """A steady run whose one scale-in drains a given instance, noting every instance's cache value then."""

    def __init__(self, settings: SimSettings, workload: Workload, victim: str) -> None:
        super().__init__(settings, workload, "cache_aware")
        self.forced, self.values_at_scale_in = victim, {}

    def _victim(self, live):  # type: ignore[no-untyped-def]
        assert self.cache_value is not None
        self.values_at_scale_in = self.cache_value.values(self.fleet.index, [i.name for i in live],
                                                          self.fleet.block_tokens)
        return self.instances[self.forced], self.values_at_scale_in.get(self.forced)


def steady_settings(c: Case, scale_in_at: float | None) -> SimSettings:
    """The case's workload at its peak rate, steady for 10 minutes, on `steady_instances` instances, one of which
    is drained at `scale_in_at` (None: never)."""
    return SimSettings(**{**c.settings.__dict__, "autoscale": AutoscaleSettings(**c.slo),
                          "instances": c.steady_instances, "rate_shape": RateShape(((0.0, 1.0), (600.0, 0.0))),
                          "scale_events": [(scale_in_at, -1)] if scale_in_at is not None else []})


def minute_hit_rate(r: SimResult, t: float) -> float:
    xs = [x for x in r.records if x.first_token is not None and t <= x.first_token < t + HIT_LOSS_WINDOW_S]
    return sum(x.cached_tokens for x in xs) / max(1, sum(x.prompt_tokens for x in xs))


def scale_in_comparison(c: Case, moments: tuple[float, ...] = STEADY_SCALE_INS) -> None:
    """At each moment, every instance is drained in a run of its own; the hit rate each drain loses is that of
    the minute after it against the same minute of the run with no scale-in (the same requests, only the drain
    differs). An arbitrary scale-in loses their mean (the expectation of a random pick, not one draw);
    cache_aware the loss of the instance whose cache value was lowest; newest the last instance's."""
    print(f"scale-in policies: {c.steady_instances} instances at the peak rate, steady; at "
          f"{', '.join(f'{t:.0f}' for t in moments)} s each instance drained in a run of its own: hit rate of the "
          "minute after, against the same minute without the drain")
    base = Simulation(steady_settings(c, None), c.workload, "cache_aware").run()
    names = [f"instance-{i}" for i in range(c.steady_instances)]
    losses: dict[str, list[float]] = {CACHE_AWARE: [], ARBITRARY: [], NEWEST: [], "best": []}
    for t in moments:
        each, values = {}, {}
        for name in names:
            sim = Drain(steady_settings(c, t), c.workload, name)
            each[name] = minute_hit_rate(base, t) - minute_hit_rate(sim.run(), t)
            values = sim.values_at_scale_in
        pick = scale_in_victim(values) or names[-1]
        losses[CACHE_AWARE].append(each[pick])
        losses[ARBITRARY].append(sum(each.values()) / len(each))
        losses[NEWEST].append(each[names[-1]])
        losses["best"].append(min(each.values()))
        ranked = sorted(names, key=lambda n: values[n])
        print(f"  at {t:.0f} s: each victim's loss (points), by cache value from the lowest: "
              + ", ".join(f"{each[n] * 100:+.2f} ({values[n]:.0f})" for n in ranked), flush=True)
    mean = {k: sum(v) / len(v) for k, v in losses.items()}
    for policy in (CACHE_AWARE, ARBITRARY, NEWEST, "best"):
        print(f"  {policy:<12} lost {mean[policy] * 100:+.2f}pp on average (each: "
              f"{', '.join(f'{x * 100:+.2f}' for x in losses[policy])})")
    if mean[ARBITRARY] > 0:
        print(f"  cache_aware / arbitrary: {mean[CACHE_AWARE] / mean[ARBITRARY]:.2f}x", flush=True)


class ValueOracle(Simulation):
    """A steady run without a drain that notes, at each moment, every instance's cache value (by each CacheValue
    variant, fed the same requests), and what losing it would have cost over the next `horizons`: the blocks of
    the requests arriving then that only it held (deeper than any other instance, when each arrived, by the
    router's prefix index), each block once, in tokens. What the value tries to foresee, without the noise of a
    drained run's divergence from the run without the drain."""

    def __init__(self, settings: SimSettings, workload: Workload, moments: tuple[float, ...],
                 variants: dict[str, CacheValue], horizons: tuple[float, ...] = (60.0, 300.0)) -> None:
        super().__init__(settings, workload, "cache_aware")
        self.variants, self.moments = variants, moments
        self.values: dict[float, dict[str, dict[str, float]]] = {}  # moment -> variant -> instance -> value
        self.lost: dict[tuple[float, float], dict[str, set[int]]] = {(m, h): {} for m in moments for h in horizons}

    def _send(self, now, arrival, req, turns, key, d):  # type: ignore[no-untyped-def]
        for m in self.moments:
            if now >= m and m not in self.values:
                names = [n for n, i in self.instances.items() if not i.draining]
                self.values[m] = {k: v.values(self.fleet.index, names, self.fleet.block_tokens)
                                  for k, v in self.variants.items()}
        if d.blocks:
            lead = sole_lead(self.fleet.index.match_depths(d.blocks))
            for (m, h), lost in self.lost.items():
                if lead is not None and m <= now < m + h:
                    lost.setdefault(lead[0], set()).update(d.blocks[lead[1]:lead[2]])
            for v in self.variants.values():
                v.requested(d.blocks)
        super()._send(now, arrival, req, turns, key, d)


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: the correlation of the ranks (ties broken by position: enough for a diagnosis)."""
    rx, ry = (np.argsort(np.argsort(v, kind="stable")) for v in (xs, ys))
    return float(np.corrcoef(rx, ry)[0, 1])


def value_oracle(c: Case, moments: tuple[float, ...], variants: list[tuple[int, float]]) -> None:
    """How well each cache value variant (max chains, window in requests) foresees the loss a drain would cause:
    its rank correlation with the blocks only each instance held among the next minute's (and five minutes')
    requests, and where its pick ranks by that loss."""
    cvs = {f"chains {n}, window {w:g}": CacheValue(max_chains=n, window=w) for n, w in variants}
    sim = ValueOracle(steady_settings(c, None), c.workload, moments, cvs)
    sim.run()
    print(f"cache value against the loss it foresees: {c.steady_instances} instances at the peak rate, steady")
    for (m, h), lost in sim.lost.items():
        names = sorted(sim.values[m][next(iter(cvs))])
        loss = [len(lost.get(n, ())) * sim.fleet.block_tokens for n in names]
        mean, by_loss = sum(loss) / len(loss), sorted(names, key=lambda n: loss[names.index(n)])
        print(f"  at {m:.0f} s, next {h:.0f} s: loss per instance mean {mean:.0f} tokens, least {min(loss)}")
        for label, values in sim.values[m].items():
            pick = scale_in_victim(values) or names[-1]
            rho, share = rank_correlation([values[n] for n in names], loss), loss[names.index(pick)] / max(mean, 1)
            print(f"    {label:<24} rho {rho:+.2f}; its pick ranks {by_loss.index(pick) + 1}/{len(names)} by loss, "
                  f"{share:.2f}x the mean")


def run(case: Case, signal: str, target: float, scale_in: str) -> AutoscaleSummary:
    a = AutoscaleSettings(autoscale=signal, scale_target=target, scale_in=scale_in, min_instances=2,
                          max_instances=64, **case.slo)
    settings = SimSettings(**{**case.settings.__dict__, "autoscale": a})
    summary = autoscale_summary(Simulation(settings, case.workload, "cache_aware").run())
    assert summary is not None
    return summary


def operating_point(sweep: list[AutoscaleSummary]) -> AutoscaleSummary | None:
    """The cheapest run of a sweep that met the SLO in at least ATTAINMENT of its windows."""
    met = [r for r in sweep if (r.slo_attainment or 0.0) >= ATTAINMENT]
    return min(met, key=lambda r: r.instance_seconds) if met else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="ramp-burst,mooncake")
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--utilization-targets", default=",".join(map(str, UTILIZATION_TARGETS)))
    parser.add_argument("--demand-targets", default=",".join(map(str, DEMAND_TARGETS)))
    parser.add_argument("--signals", default=f"{DEMAND},{UTILIZATION}", help="the signals to sweep")
    parser.add_argument("--seed", type=int, default=1, help="workload and arrival seed")
    parser.add_argument("--trace-start", type=float, default=0.0,
                        help="replay the trace from this many seconds in (the trace has no seed: its segments "
                             "are the independent samples; the shape uses ~1,230 s of it)")
    parser.add_argument("--value-oracle", default="",
                        help="only the cache value's foresight: CacheValue variants as max_chains:window,... "
                             "(the product's: 512:512), at --scale-in-moments of a steady run")
    parser.add_argument("--scale-in-only", action="store_true", help="only the scale-in policies, steady load")
    parser.add_argument("--no-scale-in", action="store_true", help="only the autoscaled sweeps")
    parser.add_argument("--slow-start-window", type=float, default=None,
                        help="the router's slow_start_window for new instances (default: the router's, 30 s; 0: off)")
    parser.add_argument("--scale-in-moments", default=",".join(f"{t:g}" for t in STEADY_SCALE_INS),
                        help="seconds into the steady run at which the scale-in policies are compared")
    args = parser.parse_args()
    targets = {DEMAND: args.demand_targets, UTILIZATION: args.utilization_targets}
    sweeps = {signal: [float(t) for t in targets[signal].split(",")] for signal in args.signals.split(",")}
    for name in args.workloads.split(","):
        c, started = case(name, args.trace, args.seed, args.trace_start), time.perf_counter()
        if args.slow_start_window is not None:
            c.settings = c.settings.changed("slow_start_window", args.slow_start_window)
        print(f"== {name}: {c.label}", flush=True)
        moments = tuple(float(t) for t in args.scale_in_moments.split(","))
        if args.value_oracle:
            value_oracle(c, moments, [(int(n), float(w)) for n, w in
                                      (v.split(":") for v in args.value_oracle.split(","))])
            continue
        if args.scale_in_only:
            scale_in_comparison(c, moments)
            continue
        runs = {signal: [run(c, signal, t, CACHE_AWARE) for t in targets] for signal, targets in sweeps.items()}
        points = {signal: operating_point(sweep) for signal, sweep in runs.items()}
        print(autoscale_table([r for sweep in runs.values() for r in sweep], slo_text(AutoscaleSettings(**c.slo))))
        for signal, point in points.items():
            print(f"{signal}: " + (f"cheapest target meeting the SLO in >= {ATTAINMENT:.0%} of windows: "
                                   f"{point.target:g}, {point.instance_seconds:.0f} instance-seconds"
                                   if point else f"no target met the SLO in {ATTAINMENT:.0%} of windows (best "
                                   f"{max(r.slo_attainment or 0.0 for r in runs[signal]):.0%})"))
        if points.get(DEMAND) and points.get(UTILIZATION):
            ratio = points[DEMAND].instance_seconds / points[UTILIZATION].instance_seconds
            print(f"demand / utilization instance-seconds at the same SLO attainment: {ratio:.2f}x")
        if not args.no_scale_in and DEMAND in runs:
            autoscaled_scale_ins(c, points[DEMAND] or max(runs[DEMAND], key=lambda r: r.slo_attainment or 0.0))
            scale_in_comparison(c, moments)
        print(f"({time.perf_counter() - started:.0f} s)\n", flush=True)


def autoscaled_scale_ins(c: Case, best_demand: AutoscaleSummary) -> None:
    """The demand signal's best run again with arbitrary and newest-first scale-in: the hit rate lost in the minute
    after each scale-in (mostly the load changing: see scale_in_comparison)."""
    others = [run(c, DEMAND, best_demand.target, policy) for policy in (ARBITRARY, NEWEST)]
    print(autoscale_table(others, slo_text(AutoscaleSettings(**c.slo))))
    if best_demand.hit_rate_lost is not None and others[0].hit_rate_lost is not None:
        print(f"hit rate lost in the minute after a scale-in (demand {best_demand.target:.2f}): cache_aware "
              f"{best_demand.hit_rate_lost:+.2%}, arbitrary {others[0].hit_rate_lost:+.2%}, newest "
              f"{fmt_loss(others[1])}")


def fmt_loss(r: AutoscaleSummary) -> str:
    return "-" if r.hit_rate_lost is None else f"{r.hit_rate_lost:+.2%}"


if __name__ == "__main__":
    main()
