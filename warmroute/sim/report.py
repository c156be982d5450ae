"""Summaries, tables, JSON and plots of simulation results."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from warmroute.bench.stats import load_spread, percentile
from warmroute.core.strategies import KV_SPILL, OVERLOAD_SPILL
from warmroute.sim.autoscale import AutoscaleSettings
from warmroute.sim.simulator import SimResult


@dataclass
class Summary:
    strategy: str
    requests: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    e2e_p50_s: float | None
    throughput_rps: float
    output_tokens_per_s: float
    hit_rate: float
    load_spread: float | None  # busiest instance's requests / mean
    spilled: float  # fraction of decisions sent away from the preferred instance for load (overload or KV spills)
    rejected: int  # no instance, or refused by the router's queue (429)
    prefixes_moved: list[tuple[float, float | None]]
    hit_rate_dips: list[dict]  # per scale event: before, lowest after, recovery seconds (0: no dip)
    ttft_p50_ms_by_class: dict[str, float | None]  # per request class of the workload ("hot", "shared", ...)
    queued: float = 0.0  # fraction of requests that waited in the router's queue
    tpot_p50_ms: float | None = None  # time per output token after the first (decode speed), median over requests
    tpot_p99_ms: float | None = None
    split: float = 0.0  # fraction of requests prefilled at one instance and decoded at another


def summarize(r: SimResult) -> Summary:
    done = [x for x in r.records if x.first_token is not None]
    ttft = [(x.first_token - x.arrival) * 1000 for x in done]
    e2e = [x.done - x.arrival for x in r.records if x.done is not None]
    tpot = [(x.done - x.first_token) * 1000 / (x.output_tokens - 1) for x in done
            if x.done is not None and x.output_tokens > 1]
    span = r.duration_s or 1.0
    return Summary(
        strategy=r.strategy, requests=len(r.records),
        ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99), e2e_p50_s=percentile(e2e, 50),
        throughput_rps=len(e2e) / span, output_tokens_per_s=sum(x.output_tokens for x in r.records) / span,
        hit_rate=r.hit_rate, load_spread=load_spread(r.requests_per_instance),
        spilled=sum(x.reason in (OVERLOAD_SPILL, KV_SPILL) for x in r.records) / max(1, len(r.records)),
        rejected=r.rejected, queued=r.queued / max(1, len(r.records) + r.rejected),
        prefixes_moved=r.prefixes_moved,
        hit_rate_dips=[_dip(r, t) for t, _ in r.prefixes_moved],
        ttft_p50_ms_by_class={tag: percentile([(x.first_token - x.arrival) * 1000 for x in done if x.tag == tag], 50)
                              for tag in sorted({x.tag for x in done})},
        tpot_p50_ms=percentile(tpot, 50), tpot_p99_ms=percentile(tpot, 99),
        split=sum(bool(x.prefill_instance) for x in r.records) / max(1, len(r.records)),
    )


def hit_rate_series(r: SimResult) -> list[tuple[float, float]]:
    """(window start s, token hit rate of requests that got their first token in it)."""
    hits: dict[int, list[int]] = {}
    for x in r.records:
        if x.first_token is not None:
            b = hits.setdefault(int(x.first_token // r.window_s), [0, 0])
            b[0] += x.cached_tokens
            b[1] += x.prompt_tokens
    return [(k * r.window_s, h / q if q else 0.0) for k, (h, q) in sorted(hits.items())]


def _dip(r: SimResult, t: float) -> dict:
    """Hit rate in the 3 windows before a scale event, the lowest window after, and the time from the event
    until a window is back within 95% of before once it has dipped below that (0.0: it never dipped; None:
    not within the run)."""
    series = hit_rate_series(r)
    before = [h for s, h in series if t - 3 * r.window_s <= s < t]
    after = [(s, h) for s, h in series if s >= t]
    if not before or not after:
        return {"at_s": t, "before": None, "lowest": None, "recovery_s": None}
    level = sum(before) / len(before)
    lowest = min(h for _, h in after)
    dipped = next((i for i, (_, h) in enumerate(after) if h < 0.95 * level), None)
    recovered = 0.0 if dipped is None else \
        next((s + r.window_s - t for s, h in after[dipped + 1:] if h >= 0.95 * level), None)
    return {"at_s": t, "before": level, "lowest": lowest, "recovery_s": recovered}


def fmt(v: float | None, spec: str) -> str:
    """A figure that may be missing (no request finished): '-' then, never a TypeError."""
    return "-" if v is None else format(v, spec)


def table(summaries: list[Summary], title: str = "") -> str:
    head = f"{'strategy':<12} {'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>7} {'tok/s':>8} {'hit rate':>8} " \
           f"{'spread':>6} {'spilled':>7} {'queued':>6} {'refused':>7}"
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for s in summaries:
        lines.append(f"{s.strategy:<12} {fmt(s.ttft_p50_ms, '8.0f')}ms {fmt(s.ttft_p99_ms, '7.0f')}ms "
                     f"{s.throughput_rps:7.2f} {s.output_tokens_per_s:8.0f} {s.hit_rate:8.1%} "
                     f"{fmt(s.load_spread, '6.2f')} {s.spilled:7.1%} {s.queued:6.1%} {s.rejected:7d}")
    for s in summaries:
        for (t, moved), dip in zip(s.prefixes_moved, s.hit_rate_dips):
            rec = "no dip below 95% of before" if dip["recovery_s"] == 0.0 else "not recovered within the run" \
                if dip["recovery_s"] is None else f"recovered in {dip['recovery_s']:.0f} s"
            lines.append(f"{s.strategy}: scale event at {t:.0f} s: {fmt(moved, '.1%')} of the prefixes sent again "
                         f"went to another instance; hit rate {fmt(dip['before'], '.1%')} -> lowest "
                         f"{fmt(dip['lowest'], '.1%')}, {rec}")
    return "\n".join(lines)


def as_json(summaries: list[Summary]) -> list[dict]:
    return [asdict(s) for s in summaries]


def plot(results: list[SimResult], out_dir: str) -> list[str]:
    """TTFT CDF per strategy, hit rate over time, and per-instance requests over time (one PNG each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ttft = sorted((x.first_token - x.arrival) * 1000 for x in r.records if x.first_token is not None)
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=r.strategy)
    ax.set_xscale("log"), ax.set_xlabel("time to first token (ms)"), ax.set_ylabel("fraction of requests")
    ax.legend(), ax.grid(alpha=0.3), ax.set_title("TTFT CDF")
    files.append(_save(fig, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        series = hit_rate_series(r)
        ax.plot([s for s, _ in series], [h for _, h in series], label=r.strategy)
    ax.set_xlabel("time (s)"), ax.set_ylabel("token hit rate"), ax.legend(), ax.grid(alpha=0.3)
    ax.set_title("KV-cache hit rate over time")
    files.append(_save(fig, out / "hit_rate.png"))

    fig, axes = plt.subplots(len(results), 1, figsize=(7, 2.2 * len(results)), squeeze=False, sharex=True)
    for ax, r in zip(axes[:, 0], results):
        per: dict[str, dict[int, int]] = {}
        for x in r.records:
            b = per.setdefault(x.instance, {})
            k = int(x.arrival // r.window_s)
            b[k] = b.get(k, 0) + 1
        for name, buckets in sorted(per.items()):
            ks = sorted(buckets)
            ax.plot([k * r.window_s for k in ks], [buckets[k] / r.window_s for k in ks], lw=0.8)
        ax.set_ylabel("req/s"), ax.set_title(f"{r.strategy}: requests per instance", fontsize=9)
    axes[-1, 0].set_xlabel("time (s)")
    files.append(_save(fig, out / "load_per_instance.png"))
    return files


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


# -- autoscaling -------------------------------------------------------------------------------------------------
REFUSED_TTFT_S = 1e9  # a refused request misses any objective
HIT_LOSS_WINDOW_S = 60.0  # hit rate lost after a scale-in: the minute after it against the minute before


@dataclass
class AutoscaleSummary:
    strategy: str
    signal: str
    target: float
    scale_in: str
    instance_seconds: float
    peak_instances: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    slo_attainment: float | None  # share of the windows whose TTFT p99 (beyond the per-token allowance) met the SLO
    windows: int
    hit_rate: float
    scale_ins: int
    hit_rate_lost: float | None  # mean over scale-ins: hit rate in the minute before - in the minute after
    rejected: int


def autoscale_summary(r: SimResult) -> AutoscaleSummary | None:
    """The autoscaling figures of a run that had an autoscaler (None otherwise)."""
    a = r.autoscale
    if a is None:
        return None
    done = [x for x in r.records if x.first_token is not None]
    ttft = [(x.first_token - x.arrival) * 1000 for x in done]
    windows = slo_windows(r)
    losses = [loss for t in sorted({e.at for e in r.scale_ins}) if (loss := hit_rate_lost(r, t)) is not None]
    return AutoscaleSummary(
        strategy=r.strategy, signal=a.autoscale or "-", target=a.scale_target, scale_in=a.scale_in,
        instance_seconds=r.instance_seconds, peak_instances=max((p for _, _, p in r.fleet_sizes), default=0),
        ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        slo_attainment=sum(windows) / len(windows) if windows else None, windows=len(windows),
        hit_rate=r.hit_rate, scale_ins=len(r.scale_ins),
        hit_rate_lost=sum(losses) / len(losses) if losses else None, rejected=r.rejected)


def slo_windows(r: SimResult) -> list[bool]:
    """Per window of arrivals (those with any request), whether its TTFT p99 met the SLO. A request's TTFT counts
    beyond its allowance (prompt tokens / slo_tokens_per_s, when set); a refused request misses it."""
    a = r.autoscale
    assert a is not None
    per: dict[int, list[float]] = {}
    for x in r.records:
        if x.first_token is not None:
            allowance = x.prompt_tokens / a.slo_tokens_per_s if a.slo_tokens_per_s else 0.0
            per.setdefault(int(x.arrival // a.slo_window_s), []).append(x.first_token - x.arrival - allowance)
    for t in r.rejected_at:
        per.setdefault(int(t // a.slo_window_s), []).append(REFUSED_TTFT_S)
    return [(percentile(v, 99) or 0.0) <= a.slo_ttft_s for _, v in sorted(per.items())]


def hit_rate_lost(r: SimResult, t: float, span: float = HIT_LOSS_WINDOW_S) -> float | None:
    """Token hit rate of the requests with a first token in the `span` before t, minus in the `span` after."""
    def rate(lo: float, hi: float) -> float | None:
        xs = [x for x in r.records if x.first_token is not None and lo <= x.first_token < hi]
        prompt = sum(x.prompt_tokens for x in xs)
        return sum(x.cached_tokens for x in xs) / prompt if prompt else None

    before, after = rate(t - span, t), rate(t, t + span)
    return before - after if before is not None and after is not None else None


def autoscale_table(rows: list[AutoscaleSummary], slo: str = "") -> str:
    head = f"{'strategy':<12} {'signal':<12} {'target':>6} {'scale-in':<11} {'inst-s':>8} {'peak':>4} {'TTFT p50':>9} " \
           f"{'TTFT p99':>9} {'SLO met':>7} {'hit rate':>8} {'scale-ins':>9} {'hit lost':>8}"
    lines = ([f"SLO: {slo}"] if slo else []) + [head, "-" * len(head)]
    for s in rows:
        lines.append(f"{s.strategy:<12} {s.signal:<12} {s.target:6.3g} {s.scale_in:<11} {s.instance_seconds:8.0f} "
                     f"{s.peak_instances:4d} {fmt(s.ttft_p50_ms, '7.0f')}ms {fmt(s.ttft_p99_ms, '7.0f')}ms "
                     f"{fmt(s.slo_attainment, '7.0%')} {s.hit_rate:8.1%} {s.scale_ins:9d} "
                     f"{fmt(None if s.hit_rate_lost is None else s.hit_rate_lost * 100, '6.2f')}pp")
    return "\n".join(lines)


def slo_text(a: AutoscaleSettings) -> str:
    per_token = f" + prompt tokens / {a.slo_tokens_per_s:g} per s" if a.slo_tokens_per_s else ""
    return f"TTFT p99 <= {a.slo_ttft_s:g} s{per_token}, per {a.slo_window_s:g} s window"
