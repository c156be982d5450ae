"""The peer comparison's figure (benchmarks/compare_peers.py writes it beside out/peers.json; `--plot-only` draws it
again from a saved JSON): a real PNG with one TTFT panel per workload and the hit-rate and throughput bars.

The JSON is built the way the benchmark builds it (BenchResult.summary, RunOutcome, row_metrics, check_targets,
result_json), from a few synthetic requests: nothing is run, no peer installed.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from warmroute.bench import compare_peers as cp  # noqa: E402
from warmroute.bench.plot import peers_figure, write_peers_figure  # noqa: E402
from warmroute.bench.stats import BenchResult, RequestRecord  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
CONTENDERS = ["random", "cache_aware", "smg cache_aware", "vllm-router cache_aware"]
PEERS = ["smg cache_aware", "vllm-router cache_aware"]
# (workload, contender) -> (TTFTs in ms, engines' hit rate); vllm-router failed to start on "hot"
RUNS = {
    ("mixed", "random"): ([300, 370, 380, 600, 980], 0.214),
    ("mixed", "cache_aware"): ([150, 190, 200, 260, 530], 0.584),
    ("mixed", "smg cache_aware"): ([170, 205, 210, 300, 770], 0.518),
    ("mixed", "vllm-router cache_aware"): ([200, 260, 280, 400, 660], 0.314),
    ("hot", "random"): ([250, 390, 400, 800, 1300], 0.622),
    ("hot", "cache_aware"): ([20, 60, 65, 120, 380], 0.797),
    ("hot", "smg cache_aware"): ([90, 140, 150, 300, 670], 0.741),
}


def outcome(workload: str, contender: str) -> cp.RunOutcome:
    if (workload, contender) not in RUNS:
        return cp.RunOutcome(workload, contender, error="router exited")
    ttfts, hit = RUNS[(workload, contender)]
    records = [RequestRecord(tag="hot" if workload == "hot" else "shared", start_s=i * 0.1, ttft_s=t / 1000,
                             e2e_s=t / 1000 + 0.05, output_tokens=2, prompt_tokens=1000, cached_tokens=int(hit * 1000))
               for i, t in enumerate(ttfts)]
    result = BenchResult(contender, "http://127.0.0.1:1", workload, "closed loop, 16 concurrent", 0.25, records,
                         fleet_hit_rate=hit, instances=4)
    return cp.RunOutcome(workload, contender, summary=result.summary(), load={"requests": [2, 1, 1, 1], "spread": 1.6},
                         ttft_quantiles_ms=cp.ttft_quantiles(result.ttft_ms()))


def peers_json(tmp_path: Path) -> tuple[dict, Path]:
    """A saved out/peers.json, as compare() writes it; read back through the file, as --plot-only reads it."""
    outcomes = [outcome(w, c) for w in ("mixed", "hot") for c in CONTENDERS]
    table: dict = {}
    for o in outcomes:
        if o.summary is not None:
            table.setdefault(o.workload, {})[o.contender] = cp.row_metrics(o, None)
    targets = [t for w in ("mixed", "hot") for t in cp.check_targets(w, table.get(w, {}), PEERS)]
    meta = {"command": ".venv/bin/python benchmarks/compare_peers.py --workloads mixed hot",
            "date": "2026-12-04 12:00 UTC", "code": "commit abc1234", "machine": "2 CPU cores",
            "config": "full configuration", "peer_versions": "smg 1.13.0", "seed": 0, "max_tokens": 2,
            "contenders": CONTENDERS, "peer_labels": PEERS,
            "workloads": [{"label": w, "load": "closed loop, 16 sessions", "description": "d",
                           "kv_capacity_tokens": 1024, "time_scale": 0.5, "working_set_tokens": 4096,
                           "largest_request_tokens": 900, "fleet_over_working_set": 1.0} for w in ("mixed", "hot")],
            "notes": []}
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(cp.result_json(meta, table, {}, targets, outcomes), indent=2))
    return json.loads(path.read_text()), path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_figure_has_a_ttft_panel_per_workload_and_the_hit_rate_and_throughput_bars(tmp_path):
    data, _ = peers_json(tmp_path)
    fig = write_peers_figure(data, tmp_path / "img" / "peers.png")
    assert [ax.get_title() for ax in fig.axes] == ["TTFT: mixed", "TTFT: hot", "fleet hit rate (%)",
                                                   "throughput (requests/s)"]
    width, height = png_size(tmp_path / "img" / "peers.png")
    assert width > 600 and height > 400 and (tmp_path / "img" / "peers.png").stat().st_size > 10_000

    mixed, hot, hit, tput = fig.axes
    # one CDF per contender measured there, drawn from the run's 101 quantiles: 0 at the fastest request, 1 at the last
    assert [line.get_label() for line in mixed.get_lines()] == CONTENDERS
    ours = mixed.get_lines()[1]
    assert list(ours.get_xdata()[[0, -1]]) == [150, 530] and list(ours.get_ydata()[[0, -1]]) == [0, 1]
    assert mixed.get_xscale() == "log"
    assert [line.get_label() for line in hot.get_lines()] == CONTENDERS[:3]
    assert "not measured: vllm-router cache_aware" in [t.get_text() for t in hot.texts]  # never silently left out

    heights = sorted(round(bar.get_height(), 1) for bar in hit.patches)
    assert heights == sorted(round(h * 100, 1) for _, h in RUNS.values())
    assert "n/m" in [t.get_text() for t in hit.texts] and "n/m" in [t.get_text() for t in tput.texts]
    assert len(tput.patches) == len(RUNS)
    assert sorted(t.get_text() for t in hit.get_xticklabels()) == ["hot", "mixed"]
    footer = fig.get_supxlabel()
    assert "commit abc1234" in footer and "2026-12-04 12:00 UTC" in footer and "compare_peers.py --workloads" in footer


def test_a_json_from_before_runs_kept_their_distribution_is_drawn_at_its_percentiles(tmp_path):
    data, _ = peers_json(tmp_path)
    for run in data["runs"]:
        run.pop("ttft_quantiles_ms")
    fig = peers_figure(data)
    ours = fig.axes[0].get_lines()[1]
    assert ours.get_label() == "cache_aware (p50/p90/p99)" and list(ours.get_ydata()) == [0.5, 0.9, 0.99]
    summary = next(r["summary"] for r in data["runs"] if (r["workload"], r["contender"]) == ("mixed", "cache_aware"))
    assert list(ours.get_xdata()) == [summary["ttft_ms"][k] for k in ("p50", "p90", "p99")]


def test_plot_only_regenerates_the_figure_from_a_saved_json_in_one_command(tmp_path):
    _, path = peers_json(tmp_path)
    figure = tmp_path / "docs" / "img" / "peers.png"
    done = subprocess.run([sys.executable, "benchmarks/compare_peers.py", "--plot-only", str(path), "--figure",
                           str(figure)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert png_size(figure)[0] > 600
    assert not (tmp_path / "peers.md").exists()  # nothing measured, no report written
    # without --figure it goes beside the JSON
    done = subprocess.run([sys.executable, "benchmarks/compare_peers.py", "--plot-only", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert png_size(tmp_path / "peers.png")[0] > 600


def test_plot_only_without_matplotlib_is_one_line_and_exit_2(tmp_path):
    _, path = peers_json(tmp_path)
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['compare_peers.py', '--plot-only', {str(path)!r}]; "
            "runpy.run_path('benchmarks/compare_peers.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "pip install 'warmroute[plot]'" in done.stderr
    assert not (tmp_path / "peers.png").exists()


def test_each_run_keeps_its_ttft_distribution_in_101_quantiles():
    qs = cp.ttft_quantiles([5.0, 1.0, 3.0])
    assert len(qs) == len(cp.TTFT_QUANTILES) == 101
    assert qs[0] == 1.0 and qs[50] == 3.0 and qs[100] == 5.0 and qs == sorted(qs)
    assert cp.ttft_quantiles([]) == []
