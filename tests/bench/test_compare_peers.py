"""The peer comparison's machinery (warmroute.bench.compare_peers): its pure helpers (ratios, targets, sizing, trace
windows, the report).

Nothing here installs or starts a peer: the peers' virtualenv and network installs are for the benchmark only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from warmroute.bench import compare_peers as cp
from warmroute.workloads.trace import TraceRecord

PEERS = ["smg cache_aware", "vllm-router cache_aware", "vllm-router consistent_hash"]


def row(p50=100.0, p99=400.0, tput=10.0, hit=0.5, spread=1.1, router=1.0, hot=None):
    return {"ttft_p50": p50, "ttft_p99": p99, "throughput": tput, "hit_rate": hit, "load_spread": spread,
            "router_ms": router, "hot_ttft_p50": hot}


# -- ratios -------------------------------------------------------------------------------------------------------
def test_ratio_and_its_undefined_cases():
    assert cp.ratio(50.0, 100.0) == 0.5
    assert cp.ratio(None, 100.0) is None
    assert cp.ratio(1.0, None) is None
    assert cp.ratio(1.0, 0.0) is None  # a zero or negative reference (e.g. a noisy router overhead) has no ratio
    assert cp.ratio(1.0, -0.2) is None


def test_best_peer_picks_by_direction_and_skips_missing():
    rows = {"smg cache_aware": row(p99=300, tput=12, hit=None), "vllm-router cache_aware": row(p99=500, tput=9),
            "cache_aware": row(p99=1, tput=99, hit=0.99)}
    assert cp.best_peer(rows, PEERS, "ttft_p99", higher_better=False) == 300
    assert cp.best_peer(rows, PEERS, "throughput", higher_better=True) == 12
    assert cp.best_peer(rows, PEERS, "hit_rate", higher_better=True) == 0.5  # smg's is unknown; ours is no peer
    assert cp.best_peer(rows, PEERS, "hot_ttft_p50", higher_better=False) is None
    assert cp.best_peer({}, PEERS, "ttft_p99", higher_better=False) is None


def test_cell_shows_value_and_ratio():
    assert cp.cell("ttft_p50", 50.0, 100.0) == "50 ms (0.50x)"
    assert cp.cell("hit_rate", 0.8, 0.4) == "80.0% (2.00x)"
    assert cp.cell("throughput", None, 3.0) == "-"
    assert cp.cell("router_ms", 1.234, None) == "1.23 ms"


# -- targets ------------------------------------------------------------------------------------------------------
def test_targets_met_when_ours_beats_every_peer():
    rows = {"cache_aware": row(p99=300, tput=12, hit=0.795),
            "smg cache_aware": row(p99=350, tput=11, hit=0.80), "vllm-router cache_aware": row(p99=500, tput=8)}
    targets = {t.name: t for t in cp.check_targets("mixed", rows, PEERS)}
    assert len(targets) == 3  # the hot-prompt targets only on "hot"
    hit = targets["hit rate >= every peer's - 1 point"]
    assert hit.met is True and hit.bound == pytest.approx(0.79)  # within one point of the best peer counts
    assert targets["TTFT p99 < every peer's"].met is True
    assert targets["throughput > every peer's"].met is True


def test_targets_missed_and_unmeasurable():
    rows = {"cache_aware": row(p99=400, tput=10, hit=0.70, spread=1.4, hot=60),
            "smg cache_aware": row(p99=400, tput=10.5, hit=0.75, hot=100),
            "vllm-router cache_aware": row(hot=150)}
    targets = {t.name: t for t in cp.check_targets("hot", rows, PEERS)}
    assert targets["hit rate >= every peer's - 1 point"].met is False
    assert targets["TTFT p99 < every peer's"].met is False  # equal is not lower
    assert targets["throughput > every peer's"].met is False
    assert targets["load max/mean <= 1.3"].met is False
    half = targets["hot TTFT p50 <= half the best peer's"]
    assert half.bound == 50 and half.met is False
    fixed = {t.metric: t for t in cp.check_targets("synthetic", rows, PEERS, fixed_rate=True)}["throughput"]
    assert fixed.bound == pytest.approx(10.395) and fixed.met is False  # a trace's rate: keep up within 1%
    rows["cache_aware"]["throughput"] = 10.4
    assert {t.metric: t for t in cp.check_targets("synthetic", rows, PEERS, fixed_rate=True)}["throughput"].met
    assert all(t.met is None for t in cp.check_targets("hot", {"cache_aware": row()}, PEERS)
               if t.name != "load max/mean <= 1.3")  # no peer ran: nothing to compare with


# -- sizing -------------------------------------------------------------------------------------------------------
def test_kv_capacity_is_a_fraction_of_the_working_set_but_fits_two_largest_requests():
    assert cp.kv_capacity_per_instance(100_000, 1_000, 4, 0.6) == 15_360  # 15,000 rounded up to 1,024
    assert cp.kv_capacity_per_instance(100_000, 20_000, 4, 0.6) == 40_960  # 2 x 20,000
    assert cp.kv_capacity_per_instance(1_000, 10, 4, 0.6) == 4_096  # floor


def test_clip_record_cuts_prompt_and_hash_ids_together():
    rec = TraceRecord(5.0, 2000, 10, (1, 2, 3, 4))
    assert cp.clip_record(rec, 4096) is rec
    cut = cp.clip_record(rec, 1000)
    assert (cut.input_length, cut.hash_ids, cut.output_length) == (1000, (1, 2), 10)


def test_trace_window_restarts_the_clock_and_clips(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": 1000 * i, "input_length": 600 * (i + 1), "output_length": 5, "hash_ids": list(range(i + 2))}
             for i in range(6)]
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    w = cp.TraceWindow(path=str(trace), start=2, limit=3, max_input_tokens=2048, max_tokens=2)
    recs = w.records
    assert [r.timestamp_ms for r in recs] == [0.0, 1000.0, 2000.0]
    assert [r.input_length for r in recs] == [1800, 2048, 2048]
    assert recs[1].hash_ids == (0, 1, 2, 3)  # 2048 tokens = 4 blocks of 512
    assert w.clipped == 2
    assert [s.requests[0].max_tokens for s in w.sessions()] == [2, 2, 2]


# -- engine load ------------------------------------------------------------------------------------------------
def test_window_load_counts_from_the_window_start():
    samples = [cp.Sample(0.0, (0, 0), (0, 0)), cp.Sample(1.0, (10, 2), (4, 0)), cp.Sample(2.0, (40, 12), (6, 2))]
    load = cp.window_load(samples, start_s=1.0)
    assert load["requests"] == [30, 10]
    assert load["spread"] == pytest.approx(1.5)
    assert load["mean_queue"] == [5.0, 1.0]
    assert cp.window_load(samples[:1], 0.0)["spread"] is None
    assert cp.spread([0, 0]) is None


def test_parse_decisions_sums_reasons():
    text = "\n".join([
        "# HELP warmroute_decisions_total Routing decisions",
        'warmroute_decisions_total{reason="cache_hit",strategy="cache_aware"} 12.0',
        'warmroute_decisions_total{reason="cold",strategy="cache_aware"} 3.0',
        'warmroute_decisions_created{reason="cold",strategy="cache_aware"} 1.7e9',
    ])
    assert cp.parse_decisions(text) == {"cache_hit": 12.0, "cold": 3.0}


# -- command lines and the report -------------------------------------------------------------------------------
def test_contender_command_lines(tmp_path):
    urls = ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    by = {c.label: c for c in cp.CONTENDERS}
    ours = by["cache_aware"].argv(8080, 8081, urls, 4096, tmp_path)
    assert ours[1:4] == ["-m", "warmroute", "serve"]
    assert ours[-2:] == ["--backend", "engine-1=http://127.0.0.1:9001"] and "--kv-events" not in ours
    precise = by["precise"].argv(8080, 8081, urls, 4096, tmp_path)
    assert precise[precise.index("--strategy") + 1] == "cache_aware" and "--kv-events" in precise
    assert (Path(precise[precise.index("--tokenizer") + 1]) / "tokenizer.json").exists()
    assert "--kv-events-port" in cp.engine_argv(9000, 4096, 0.5, 8, 9100)
    assert "--kv-events-port" not in cp.engine_argv(9000, 4096, 0.5, 8)
    smg = by["smg cache_aware"].argv(8080, 8081, urls, 4096, tmp_path)
    assert smg[:2] == [str(tmp_path / "bin" / "smg"), "launch"]
    assert smg[smg.index("--worker-urls") + 1:smg.index("--worker-urls") + 3] == urls
    assert smg[smg.index("--prometheus-port") + 1] == "8081"  # never the default 29000 shared by both peers
    vr = by["vllm-router consistent_hash"].argv(8080, 8081, urls, 4096, tmp_path)
    assert vr[0] == str(tmp_path / "bin" / "vllm-router") and vr[vr.index("--policy") + 1] == "consistent_hash"
    assert {c.label for c in cp.CONTENDERS if c.is_peer} == set(PEERS)


def test_report_has_command_tables_and_targets():
    meta = {"command": ".venv/bin/python benchmarks/compare_peers.py --quick", "date": "today", "machine": "2 cores",
            "config": "reduced", "peer_versions": "smg 1, vllm-router 2", "seed": 0, "max_tokens": 2,
            "contenders": ["cache_aware", *PEERS], "peer_labels": PEERS,
            "workloads": [{"label": "hot", "load": "closed loop", "description": "d", "kv_capacity_tokens": 1024,
                           "time_scale": 0.5, "fleet_over_working_set": 0.6}], "notes": ["vllm-router: x"]}
    table = {"hot": {"cache_aware": row(hot=20), "smg cache_aware": row(p50=200, hot=80)}}
    failed = cp.RunOutcome("hot", "vllm-router cache_aware", error="router exited")
    text = cp.render_report(meta, table, [failed], cp.check_targets("hot", table["hot"], PEERS))
    assert "    .venv/bin/python benchmarks/compare_peers.py --quick" in text.splitlines()[:6]
    assert "| **cache_aware** | 100 ms (0.50x) |" in text
    assert "| hot | hot TTFT p50 <= half the best peer's | 20 ms | 40 ms | yes |" in text
    assert "- hot / vllm-router cache_aware: router exited" in text and "- vllm-router: x" in text


def test_chat_is_measured_over_a_longer_window_than_the_other_loops():
    import argparse

    args = argparse.Namespace(duration=15.0, warmup=5.0, seed=0)
    by_label = {p.label: p for p in cp.plans(quick=False)}
    urls = ["http://127.0.0.1:1"]
    windows = {label: cp.bench_settings(by_label[label], args, "m", urls, label).duration_s
               for label in ("mixed", "hot", "hot-open", "chat")}
    assert windows == {"mixed": 15.0, "hot": 15.0, "hot-open": 15.0, "chat": 60.0}
    assert "4x the window" in cp.load_text(by_label["chat"], None)
