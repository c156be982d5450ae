"""TTFT distribution of each run (empirical CDF, log time axis) as a PNG."""

from __future__ import annotations

from collections.abc import Sequence

from warmroute.bench.stats import BenchResult
from warmroute.errors import UsageError


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
