"""`warmroute simulate`: a fleet in virtual time, strategies compared side by side, what-if sweeps."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Annotated

from pydantic import TypeAdapter, ValidationError

from warmroute.bench.cli import add_workload_arguments, workload_from_args
from warmroute.core.disaggregation import DisaggregationSettings
from warmroute.core.strategies import STRATEGIES, StrategySettings
from warmroute.router.settings import RouterSettings
from warmroute.router.settings_cli import add_setting_arguments, cli_values, field_of, setting_names
from warmroute.router.settings_load import describe_errors, profiles_from, read_config_file, strategy_settings_from
from warmroute.errors import UsageError
from warmroute.sim.autoscale import AutoscaleSettings
from warmroute.sim.report import (Summary, as_json, autoscale_summary, autoscale_table, fmt, plot, slo_text,
                                  summarize, table)
from warmroute.sim.scenarios import SCENARIOS
from warmroute.sim.simulator import SimResult, SimSettings, Simulation
from warmroute.workloads.base import Workload
from warmroute.workloads.rate_shape import NAMED as NAMED_SHAPES, parse_rate_shape

REFERENCES = ("oracle", "pooled", "sglang_like")
# Settings a --sweep may vary, with their type: the simulator's own, and every strategy setting.
SWEEPABLE = {**{f.name: f.type for f in dataclasses.fields(SimSettings)
                if f.name in ("instances", "kv_capacity_tokens", "router_kv_capacity_tokens", "max_running", "rate",
                              "concurrency", "speedup")},
             **{name: str(field_of(name).annotation) for name in setting_names(StrategySettings)
                if field_of(name).annotation in (int, float, bool)}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS),
                        help="a named experiment (reference-70b: the published benchmark, 16 configurations)")
    parser.add_argument("--strategies", default="random,prefix,cache_aware,oracle,pooled",
                        help="comma-separated; any router strategy (also one defined in --config), the references "
                             "oracle and pooled, and the peer model sglang_like")
    parser.add_argument("--config", metavar="FILE",
                        help="a `warmroute serve` YAML config: its strategy settings (flags win; its other settings "
                             "are ignored) and the strategies it defines under `strategies`, which --strategies may "
                             "name")
    f = parser.add_argument_group("fleet")
    f.add_argument("--instances", type=int, default=8)
    f.add_argument("--profile", choices=("8b", "70b"), default="8b")
    f.add_argument("--kv-capacity-tokens", type=int, help="per instance (default: the profile's)")
    f.add_argument("--max-running", type=int, default=64)
    f.add_argument("--prefill-instances", type=int, default=0, metavar="P",
                   help="disaggregated serving: the first P instances prefill, the others decode (default 0: every "
                        "instance serves whole requests)")
    f.add_argument("--transfer-tokens-per-s", type=float, default=SimSettings.transfer_tokens_per_s, metavar="R",
                   help="disaggregated serving: how fast a prompt's KV cache moves between instances")
    r = parser.add_argument_group("router", "the strategies' settings, as `warmroute serve` takes them")
    add_setting_arguments(r, StrategySettings)
    add_setting_arguments(r, DisaggregationSettings)
    r.add_argument("--router-kv-capacity-tokens", type=int, metavar="N",
                   help="the router's idea of each instance's KV capacity, to study misconfiguration "
                        "(default: the engines' real capacity)")
    r.add_argument("--feedback", action=argparse.BooleanOptionalAction, default=True,
                   help="correct the router's index from the cached tokens engines report (default: on)")
    g = parser.add_argument_group("load")
    g.add_argument("--requests", type=int, default=10_000)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, metavar="QPS", help="open loop: Poisson session arrivals per second")
    mode.add_argument("--concurrency", type=int, metavar="C", help="closed loop: C sessions in flight")
    g.add_argument("--speedup", type=float, default=1.0, help="trace replay: run its clock this much faster")
    g.add_argument("--rate-shape", metavar="SHAPE",
                   help=f"multiply the arrival rate (--rate) or the trace's speed over time: {', '.join(NAMED_SHAPES)} "
                        "or T:M,T:M,... (from T seconds, M times; a last M of 0 ends the arrivals)")
    g.add_argument("--scale-at", action="append", default=[], metavar="T:+1",
                   help="add (+1) or remove (-1) an instance at T seconds (repeatable)")
    g.add_argument("--sweep", metavar="NAME=V1,V2,...", help=f"vary one of: {', '.join(SWEEPABLE)}")
    a = parser.add_argument_group("autoscaling", "an autoscaler in virtual time (sim/autoscale.py), and how a "
                                                 "scale-in (also --scale-at -1) picks its victim")
    add_setting_arguments(a, AutoscaleSettings,
                          aliases={"min_instances": "--min", "max_instances": "--max", "scale_target": "--target"})
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true")
    o.add_argument("--plot", metavar="DIR", help="write TTFT CDF, hit rate and load plots here")


def _validated(name: str, value: object, flag: str | None = None) -> None:
    """Check a value against the router's own settings model (one set of valid ranges)."""
    field = RouterSettings.model_fields[name]
    try:
        TypeAdapter(Annotated[field.annotation, *field.metadata]).validate_python(value)
    except ValidationError as exc:
        raise UsageError(f"{flag or '--' + name.replace('_', '-')} {value}: {exc.errors()[0]['msg']}") from None


def _config(args: argparse.Namespace) -> dict:
    """The --config file's values (empty without one)."""
    return read_config_file(args.config) if getattr(args, "config", None) else {}


def settings_from_args(args: argparse.Namespace, workload: Workload) -> SimSettings:
    config = _config(args)
    routing = strategy_settings_from(args, config)
    if args.router_kv_capacity_tokens is not None:
        _validated("kv_capacity_tokens", args.router_kv_capacity_tokens, "--router-kv-capacity-tokens")
    for name in ("instances", "requests", "max_running"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.prefill_instances < args.instances:
        raise UsageError("--prefill-instances must be from 0 to --instances - 1 (at least one instance decodes)")
    if args.transfer_tokens_per_s <= 0:
        raise UsageError("--transfer-tokens-per-s must be > 0")
    try:
        autoscale = AutoscaleSettings(**cli_values(args, AutoscaleSettings))
        pd = DisaggregationSettings(**cli_values(args, DisaggregationSettings))
    except ValidationError as exc:
        raise UsageError("; ".join(f"--{str(e['loc'][0]).replace('_', '-')} {e.get('input')}: {e['msg']}"
                                   if e.get("loc") else e["msg"].removeprefix("Value error, ")
                                   for e in exc.errors())) from None
    if args.rate_shape and (args.concurrency is not None or args.rate is None and workload.name != "trace"):
        raise UsageError("--rate-shape shapes open-loop arrivals (--rate) or a trace's clock, not --concurrency")
    closed = args.concurrency if args.rate is None and workload.name != "trace" else args.concurrency
    if workload.name != "trace" and args.rate is None and args.concurrency is None:
        closed = 32
    return SimSettings(
        instances=args.instances, profile=args.profile, kv_capacity_tokens=args.kv_capacity_tokens,
        max_running=args.max_running, router_kv_capacity_tokens=args.router_kv_capacity_tokens,
        feedback=args.feedback, routing=routing, profiles=profiles_from(config),
        requests=args.requests,
        rate=args.rate, concurrency=closed, speedup=args.speedup,
        rate_shape=parse_rate_shape(args.rate_shape) if args.rate_shape else None,
        scale_events=[_scale_event(s) for s in args.scale_at], autoscale=autoscale, seed=args.seed,
        prefill_instances=args.prefill_instances, transfer_tokens_per_s=args.transfer_tokens_per_s,
        pd=pd)


def _scale_event(text: str) -> tuple[float, int]:
    t, sep, delta = text.partition(":")
    try:
        if sep and delta.strip() in ("+1", "-1", "1"):
            return float(t), int(delta)
    except ValueError:
        pass
    raise UsageError(f"--scale-at expects T:+1 or T:-1 (seconds), got {text!r}")


def _strategies(text: str, profiles: Mapping[str, object] | None = None) -> list[str]:
    """The --strategies names: built-in, defined in the --config file (`profiles`), or references."""
    known = [*STRATEGIES, *(profiles or {}), *REFERENCES]
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"unknown strategy {unknown[0] if unknown else text!r}; choose from {', '.join(known)}"
                         + ("" if profiles else " (or one defined under `strategies` in a --config file)"))
    return names


def simulate(settings: SimSettings, workload: Workload, strategies: list[str]) -> list[SimResult]:
    return [Simulation(settings, workload, s, pooled=(s == "pooled")).run() for s in strategies]


def _sweep(text: str) -> tuple[str, list[object]]:
    name, sep, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in SWEEPABLE:
        raise UsageError(f"--sweep expects NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}")
    kind = float if "float" in str(SWEEPABLE[name]) else int
    try:
        return name, [kind(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--sweep {name}: values must be {kind.__name__}s") from None


def run(args: argparse.Namespace) -> int:
    profiles = profiles_from(_config(args))
    strategies = _strategies(args.strategies, profiles)
    if args.plot:
        from warmroute.bench.plot import require_matplotlib

        require_matplotlib()
    started = time.perf_counter()
    if args.scenario:
        return _run_scenario(args, strategies, started, profiles)
    workload = workload_from_args(args)
    base = settings_from_args(args, workload)
    runs: list[tuple[str, SimSettings]] = [("", base)]
    if args.sweep:
        name, values = _sweep(args.sweep)
        runs = [(f"{name}={v}", _changed(base, name, v)) for v in values]
    out: list[dict] = []
    best: tuple[float, str] | None = None
    for label, settings in runs:
        results = simulate(settings, workload, strategies)
        summaries = [summarize(r) for r in results]
        scaled = [a for r in results if (a := autoscale_summary(r)) is not None]
        out.append({"setting": label, "results": as_json(summaries),
                    **({"autoscale": [dataclasses.asdict(a) for a in scaled]} if scaled else {})})
        if not args.json:
            print(table(summaries, title=label or _describe(settings, workload)), end="\n\n")
            if scaled:
                print(autoscale_table(scaled, slo_text(settings.autoscale)), end="\n\n")
        if args.plot:
            plot(results, f"{args.plot}/{label.replace('=', '-')}" if label else args.plot)
        best = _better(best, label, summaries)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        if args.sweep and best:
            print(f"best setting for {_main_strategy(strategies)} by TTFT p50: {best[1]}")
        print(f"simulated in {time.perf_counter() - started:.1f} s")
    return 0


def _changed(base: SimSettings, name: str, value: object) -> SimSettings:
    try:
        return base.changed(name, value)
    except ValidationError as exc:
        raise UsageError(f"--sweep {name}={value}: {describe_errors(exc)}") from None


def _main_strategy(strategies: list[str]) -> str:
    routers = [s for s in strategies if s not in REFERENCES]
    return "cache_aware" if "cache_aware" in routers else (routers or strategies)[-1]


def _better(best: tuple[float, str] | None, label: str, summaries: list[Summary]) -> tuple[float, str] | None:
    main = _main_strategy([s.strategy for s in summaries])
    s = next(s for s in summaries if s.strategy == main)
    if s.ttft_p50_ms is None:
        return best
    return (s.ttft_p50_ms, label) if best is None or s.ttft_p50_ms < best[0] else best


def _describe(s: SimSettings, w: Workload) -> str:
    load = f"{s.rate} req/s" if s.rate else (f"{s.concurrency} concurrent" if s.concurrency else
                                              f"trace clock x{s.speedup}")
    cap = s.kv_capacity_tokens or "profile"
    router = f" (router assumes {s.router_kv_capacity_tokens})" if s.router_kv_capacity_tokens else ""
    return (f"workload {w.name}, {s.instances} x {s.profile} instances, KV {cap} tokens each{router}, {load}, "
            f"{s.requests} requests, feedback {'on' if s.feedback else 'off'}")


def _run_scenario(args: argparse.Namespace, strategies: list[str], started: float,
                  profiles: dict | None = None) -> int:
    cases = SCENARIOS[args.scenario](requests=args.requests, seed=args.seed)
    rows = []
    for case in cases:
        settings = dataclasses.replace(case.settings, profiles=profiles or {})
        summaries = {r.strategy: summarize(r) for r in simulate(settings, case.workload, strategies)}
        rows.append({"case": case.label, "results": {k: dataclasses.asdict(v) for k, v in summaries.items()}})
        if not args.json:
            print(_scenario_row(case.label, summaries), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"simulated {len(cases)} configurations in {time.perf_counter() - started:.0f} s")
    return 0


def _scenario_row(label: str, s: dict[str, Summary]) -> str:
    """One configuration: hit rates, and each router's TTFT p50 / throughput change against random."""
    base = s.get("random")
    parts = [f"{label:<36}"]
    for name, v in s.items():
        part = f"{name}: hit {v.hit_rate:.0%} p50 {fmt(v.ttft_p50_ms, '.0f')}ms"
        if base and name != "random" and base.ttft_p50_ms and v.ttft_p50_ms is not None:
            part += (f" ({v.ttft_p50_ms / base.ttft_p50_ms - 1:+.0%} TTFT, "
                     f"{v.throughput_rps / base.throughput_rps - 1:+.0%} thr)")
        parts.append(part)
    return " | ".join(parts)
