"""Figures as PNGs: the TTFT distribution of each run (empirical CDF, log time axis), and the peer comparison's
headline figure (TTFT per workload, hit rate and throughput bars)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmroute.bench.stats import BenchResult
from warmroute.errors import UsageError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def require_matplotlib() -> None:
    """--plot needs the optional `plot` extra; say so before any work is done, in one line."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'warmroute[plot]'") from None


def plot_ttft(results: Sequence[BenchResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for r in results:
        xs = sorted(r.ttft_ms())
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=r.label)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)


# -- the peer comparison's figure (benchmarks/compare_peers.py) -----------------------------------------------------
OURS = "cache_aware"  # warmroute's strategy in compare_peers' contender labels; drawn bold


def peers_figure(data: dict[str, Any]) -> Figure:
    """The headline figure of out/peers.json (warmroute.bench.compare_peers.result_json): one panel per workload
    with each contender's TTFT distribution (empirical CDF over a log time axis), then two bar panels, fleet hit
    rate and throughput, per workload and contender. A run without its distribution (a JSON written before runs
    kept one) is drawn at its p50, p90 and p99 only; a contender not measured on a workload is said to be so."""
    from matplotlib.figure import Figure

    meta = data.get("meta", {})
    workloads = [w["label"] for w in meta.get("workloads", [])] or sorted(data.get("table", {}))
    table = data.get("table", {})
    contenders = list(meta.get("contenders", [])) or sorted({c for rows in table.values() for c in rows})
    runs = {(r["workload"], r["contender"]): r for r in data.get("runs", [])}
    colours = {c: f"C{i % 10}" for i, c in enumerate(contenders)}
    if not workloads or not contenders:
        raise UsageError("no workload or contender in the results: nothing to plot")

    cols = max(len(workloads), 2)
    fig = Figure(figsize=(3.6 * cols, 7.4), dpi=110, layout="constrained")
    grid = fig.add_gridspec(2, cols)
    for i, w in enumerate(workloads):
        ax = fig.add_subplot(grid[0, i])
        _ttft_panel(ax, w, contenders, runs, colours)
    half = cols // 2
    for (key, title, scale), cells in zip((("hit_rate", "fleet hit rate (%)", 100.0),
                                          ("throughput", "throughput (requests/s)", 1.0)),
                                         (grid[1, :half], grid[1, half:])):
        _bar_panel(fig.add_subplot(cells), key, title, scale, workloads, contenders, data.get("table", {}), colours)
    handles: dict[str, Any] = {}
    for ax in fig.axes:  # one legend for all panels: a contender has one colour everywhere
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside upper center", ncols=min(len(handles), 6), fontsize=8)
    # what was measured when, on which code, by which command: beneath the panels
    footer = ", ".join(x for x in (meta.get("date"), meta.get("code")) if x)
    footer += (": " if footer and meta.get("command") else "") + meta.get("command", "")
    if footer:
        fig.supxlabel(footer, fontsize=7, family="monospace", wrap=True)
    return fig


def _ttft_panel(ax: Axes, workload: str, contenders: Sequence[str], runs: dict[tuple[str, str], dict[str, Any]],
                colours: dict[str, str]) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    missing = []
    for c in contenders:
        run = runs.get((workload, c))
        summary = (run or {}).get("summary")
        if not summary:
            missing.append(c)
            continue
        width = 2.2 if c == OURS else 1.2
        qs = run.get("ttft_quantiles_ms") or []
        if qs:
            ax.step(qs, [q / 100 for q in range(len(qs))], where="post", color=colours[c], lw=width, label=c)
        else:
            t = summary.get("ttft_ms", {})
            pts = [(t[k], f) for k, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)) if t.get(k) is not None]
            if not pts:
                missing.append(c)
                continue
            ax.plot(*zip(*pts), marker="o", color=colours[c], lw=width, label=f"{c} (p50/p90/p99)")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 100, 200, 500: ms, not 10^2
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(0, 1.02)
    ax.set_title(f"TTFT: {workload}")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    if missing:
        ax.text(0.02, 0.98, "not measured: " + ", ".join(missing), transform=ax.transAxes, fontsize=7,
                va="top", wrap=True)


def _bar_panel(ax: Axes, key: str, title: str, scale: float, workloads: Sequence[str], contenders: Sequence[str],
               table: dict[str, dict[str, dict[str, float | None]]], colours: dict[str, str]) -> None:
    width = 0.8 / len(contenders)
    for j, c in enumerate(contenders):
        for i, w in enumerate(workloads):
            x = i - 0.4 + width * (j + 0.5)
            value = (table.get(w, {}).get(c) or {}).get(key)
            if value is None:  # never a silent gap: the contender was not measured there
                ax.text(x, 0, "n/m", rotation=90, ha="center", va="bottom", fontsize=6, color=colours[c])
                continue
            bars = ax.bar(x, value * scale, width, color=colours[c], label=c,
                          edgecolor="black" if c == OURS else "none")
            ax.bar_label(bars, fmt="%.1f" if scale != 1.0 or value < 100 else "%.0f", fontsize=6, rotation=90,
                         padding=2)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_title(title)
    ax.margins(y=0.15)
    ax.grid(True, axis="y", alpha=0.3)


def write_peers_figure(data: dict[str, Any], path: str | Path) -> Figure:
    """peers_figure(data) as a PNG at `path` (its folder made); the Figure, for a caller to inspect."""
    fig = peers_figure(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return fig
