"""Results as a table, one column per run, so strategies (or peers) read side by side."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from warmroute.bench.formats import ms, number, pct
from warmroute.bench.stats import BenchResult

Row = tuple[str, Callable[[dict[str, Any]], str]]


def _shares(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    return " ".join(f"{100 * n / total:.0f}" for n in counts.values()) + " %" if total else "-"


def _prediction(p: dict[str, Any]) -> str:
    """Predicted minus reported cached tokens per request; the signed mean shows a bias."""
    if not p["requests"]:
        return "-"
    return f"{p['median_abs']:,.0f} / {p['p90_abs']:,.0f} tok (mean {p['mean']:+,.0f})"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in errors.items()) or "0"


ROWS: list[Row] = [
    ("load", lambda s: s["mode"]),
    ("requests measured", lambda s: f"{s['requests']:,}"),
    ("errors", lambda s: _errors(s["errors"])),
    ("TTFT p50", lambda s: ms(s["ttft_ms"]["p50"])),
    ("TTFT p90", lambda s: ms(s["ttft_ms"]["p90"])),
    ("TTFT p99", lambda s: ms(s["ttft_ms"]["p99"])),
    ("end-to-end p50", lambda s: ms(s["e2e_ms"]["p50"])),
    ("end-to-end p99", lambda s: ms(s["e2e_ms"]["p99"])),
    ("throughput", lambda s: number(s["throughput"]["requests_per_s"], 1, " req/s")),
    ("output tokens", lambda s: number(s["throughput"]["output_tokens_per_s"], 1, " tok/s")),
    ("token hit rate (fleet)", lambda s: pct(s["hit_rate"]["fleet"])),
    ("token hit rate (client)", lambda s: pct(s["hit_rate"]["client"])),
    ("prediction error |p50| / |p90|", lambda s: _prediction(s["prediction_error_tokens"])),
    ("load spread (max/mean)", lambda s: number(s["instances"]["load_spread"], 1, "x")),
    ("requests per instance", lambda s: _shares(s["instances"]["requests"])),
]


# The demo's short table: what differs between routing strategies.
COMPACT_ROWS: list[Row] = [row for row in ROWS if row[0] in (
    "requests measured", "errors", "TTFT p50", "TTFT p99", "throughput", "token hit rate (fleet)",
    "load spread (max/mean)")]


def render_table(results: Sequence[BenchResult], title: str = "", rows: Sequence[Row] = ROWS,
                 by_class: bool = True) -> Table:
    summaries = [r.summary() for r in results]
    table = Table(title=title or None, title_justify="left")
    table.add_column("")
    for s in summaries:
        table.add_column(s["label"], justify="right")
    for name, cell in rows:
        table.add_row(name, *(cell(s) for s in summaries))
    if by_class:
        for tag in sorted({t for s in summaries for t in s["by_class"]}):
            table.add_row(f"  {tag}: TTFT p50 / hit", *(_class_cell(s["by_class"].get(tag)) for s in summaries))
    return table


def _class_cell(c: dict[str, Any] | None) -> str:
    return "-" if not c else f"{ms(c['ttft_p50_ms'])} / {pct(c['client_hit_rate'])}"


def print_results(results: Sequence[BenchResult], *, as_json: bool = False, title: str = "",
                  rows: Sequence[Row] = ROWS, console: Console | None = None) -> None:
    """The table (or JSON: one object, or a list for several runs) on stdout; warnings on stderr."""
    if as_json:
        data = [r.summary() for r in results]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=2))
        return
    console = console or Console()
    console.print(render_table(results, title, rows, by_class=rows is ROWS))
    err = Console(stderr=True)
    for r in results:
        for w in r.warnings:
            err.print(f"[yellow]warning[/] ({r.label}): {w}")
