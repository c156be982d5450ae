"""The load generator: statistics from plain values, SSE measurement over real HTTP, CLI errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from fake_upstream import Upstream
from warmroute.bench.formats import markdown_table, number, pct
from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.processes import Child
from warmroute.bench.record import write_outputs
from warmroute.bench.report import render_table
from warmroute.bench.stats import BenchResult, RequestRecord, load_spread, percentile
from warmroute.cli import main
from warmroute.errors import UsageError
from warmroute.prometheus_text import sample_sum
from warmroute.workloads import make_workload


# -- statistics ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0


def test_load_spread_counts_idle_instances():
    assert load_spread({"a": 10, "b": 10}) == 1.0
    assert load_spread({"a": 30, "b": 10}) == 1.5
    assert load_spread({"a": 20}, instances=4) == 4.0
    assert load_spread({}) is None


def test_sample_sum_reads_prometheus_text():
    text = "\n".join([
        "# HELP vllm:prefix_cache_hits_total Hits.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="m x"} 120.0',
        'vllm:prefix_cache_hits_total{engine="1"} 30',
        "vllm:prefix_cache_hits_created 1.7e9",
        "vllm:prefix_cache_queries_total 400",
    ])
    assert sample_sum(text, "vllm:prefix_cache_hits_total") == 150.0
    assert sample_sum(text, "vllm:prefix_cache_queries_total") == 400.0
    assert sample_sum(text, "vllm:num_requests_running") is None
    with pytest.raises(ValueError):
        sample_sum("vllm:prefix_cache_hits_total{engine=\"0\" 1\n", "vllm:prefix_cache_hits_total")


async def test_a_child_is_ready_when_it_serves_a_model_and_a_failed_one_says_why(tmp_path):
    argv = [sys.executable, "-m", "warmroute.bench.trivial", "--port", "0", "--model", "tiny"]
    with Child.command("instance", argv, tmp_path) as child:
        url = await child.wait_for_url(timeout_s=30)
        assert await child.wait_for_model(url, timeout_s=30) == "tiny"
    assert child.proc.returncode is not None  # stopped on leaving the block
    with Child("broken", ["--port", "not-a-port"], tmp_path, module="warmroute.bench.trivial") as broken:
        with pytest.raises(UsageError, match="broken exited with status 2: .*invalid int value"):
            await broken.wait_for_log("listening on", 1, timeout_s=30)


def test_outputs_are_json_and_a_markdown_fragment_beside_it(tmp_path):
    written = write_outputs(tmp_path / "sub" / "run.json", {"rps": 1.5}, "## Section\n\n" + "\n".join(
        markdown_table(["name", "value"], "lr", [["a", number(1234.5, 1)], ["b", pct(None)]])))
    assert written == [tmp_path / "sub" / "run.json", tmp_path / "sub" / "run.md"]
    assert json.loads(written[0].read_text()) == {"rps": 1.5}
    assert written[1].read_text() == "## Section\n\n| name | value |\n| --- | ---: |\n| a | 1,234.5 |\n| b | - |\n"


def record(tag="shared", ttft=0.1, e2e=0.5, out=8, prompt=100, cached=50, instance="a", error=None):
    return RequestRecord(tag, 0.0, ttft, e2e, out, prompt, cached, instance, error)


def test_summary_from_plain_records():
    recs = [record(ttft=t / 1000, instance=i) for t, i in zip(range(10, 110, 10), "aabbbbcccc")]
    recs += [record(error="http_503"), record(error="timeout"), record(error="timeout")]
    s = BenchResult("x", "http://t", "shared", "closed loop", 2.0, recs, fleet_hit_rate=0.25, instances=4).summary()
    assert s["requests"] == 10
    assert s["errors"] == {"http_503": 1, "timeout": 2}
    assert s["ttft_ms"]["p50"] == 55.0 and s["ttft_ms"]["p99"] == pytest.approx(99.1)
    assert s["throughput"] == {"requests_per_s": 5.0, "output_tokens_per_s": 40.0}
    assert s["hit_rate"] == {"fleet": 0.25, "client": 0.5}
    assert s["instances"] == {"requests": {"a": 2, "b": 4, "c": 4}, "load_spread": 1.6}
    assert s["by_class"]["shared"]["requests"] == 10
    assert s["prediction_error_tokens"] == {"requests": 0, "median_abs": None, "p90_abs": None, "mean": None}
    assert list(s) == ["label", "target", "workload", "mode", "duration_s", "requests", "errors", "ttft_ms",
                       "e2e_ms", "throughput", "hit_rate", "prediction_error_tokens", "instances", "by_class",
                       "warnings"]
    assert render_table([BenchResult("x", "t", "w", "m", 1.0, recs)]).columns[1].header == "x"


def test_prediction_error_is_predicted_minus_reported_cached_tokens_in_the_engines_count():
    recs = [record(prompt=200, cached=100), record(prompt=200, cached=0), record(prompt=100, cached=100),
            record(prompt=100, cached=None), record(error="timeout")]
    for r, predicted in zip(recs, (0.5, 0.25, 0.0, 1.0, 1.0)):
        r.predicted_hit = predicted
    assert [r.prediction_error_tokens for r in recs] [:4] == [0.0, 50.0, -100.0, None]
    s = BenchResult("x", "t", "w", "m", 1.0, recs).summary()
    assert s["prediction_error_tokens"] == {"requests": 3, "median_abs": 50.0, "p90_abs": 90.0, "mean": -16.7}


# -- over HTTP: a small stand-in engine ------------------------------------------------------------------------
class FakeEngine:
    """A stand-in instance (fake_upstream.Upstream, serving model `fake-model`) that streams `tokens` content
    chunks, then usage with half the prompt cached, and counts cache tokens in its /metrics."""

    def __init__(self, tokens: int = 3, status: int = 200) -> None:
        self.tokens, self.status = tokens, status
        self.hits = self.queries = 0
        self.turns: list[int] = []  # messages in each request received
        self.upstream = Upstream("engine-1", ("fake-model",))
        self.upstream.behaviour = self.answer

    async def answer(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics":
            return web.Response(text=f"vllm:prefix_cache_hits_total {self.hits}\n"
                                     f"vllm:prefix_cache_queries_total {self.queries}\n")
        return await self.chat(request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "fake-model"
        self.turns.append(len(body["messages"]))
        if self.status != 200:
            return web.json_response({"error": {"message": "busy"}}, status=self.status)
        resp = web.StreamResponse(headers={"x-warmroute-instance": "engine-1"})
        await resp.prepare(request)
        for i in range(self.tokens):
            await asyncio.sleep(0.005)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.hits, self.queries = self.hits + 50, self.queries + 100
        usage = {"prompt_tokens": 100, "completion_tokens": self.tokens,
                 "prompt_tokens_details": {"cached_tokens": 50}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp


SMALL = {"pool_size": 4, "system_tokens": 50, "question_tokens": 10}


@pytest.fixture
async def fake_engine():
    """start(**FakeEngine's arguments) -> (the engine, its base URL); stopped after the test."""
    started: list[FakeEngine] = []

    async def start(**kwargs) -> tuple[FakeEngine, str]:
        engine = FakeEngine(**kwargs)
        await engine.upstream.start()
        started.append(engine)
        return engine, engine.upstream.url

    yield start
    for engine in started:
        await engine.upstream.stop()


async def test_bench_measures_a_streaming_server(fake_engine):
    engine, url = await fake_engine()
    settings = BenchSettings(concurrency=4, duration_s=0.6, warmup_s=0.2, engine_metrics=[url + "/metrics"])
    result = await run_bench(url, make_workload("shared", **SMALL), settings)
    s = result.summary()
    assert s["requests"] > 10 and s["errors"] == {}
    assert 5 <= s["ttft_ms"]["p50"] < s["e2e_ms"]["p50"]
    assert s["hit_rate"]["client"] == 0.5 and s["hit_rate"]["fleet"] == pytest.approx(0.5)
    assert s["instances"]["requests"] == {"engine-1": s["requests"]}
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(3 * s["throughput"]["requests_per_s"], rel=0.01)


async def test_bench_counts_errors_by_kind(fake_engine):
    _, url = await fake_engine(status=503)
    result = await run_bench(url, make_workload("shared", **SMALL),
                             BenchSettings(rate=50, duration_s=0.3, warmup_s=0))
    assert result.summary()["requests"] == 0 and result.errors["http_503"] > 3
    assert result.duration_s == pytest.approx(0.3, abs=0.02)  # the window, though no arrival ends it


async def test_a_refused_turn_ends_its_conversation(fake_engine):
    # The next turn's history would hold an answer that never came: a prefix no instance computed.
    engine, url = await fake_engine(status=429)
    chats = make_workload("chat", system_tokens=20, user_tokens=5, reply_tokens=5, min_turns=3, max_turns=3)
    result = await run_bench(url, chats, BenchSettings(rate=40, duration_s=0.5, warmup_s=0))
    assert result.errors["http_429"] == len(engine.turns) > 3
    assert set(engine.turns) == {2}  # system + first question, never a later turn


async def test_trace_replay_follows_timestamps_and_ends_with_the_trace(fake_engine, tmp_path):
    lines = [{"timestamp": t, "input_length": 100, "output_length": 2, "hash_ids": [0]} for t in (0, 1000, 2000)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    _, url = await fake_engine()
    result = await run_bench(url, make_workload("trace", path=str(tmp_path / "t.jsonl")),
                             BenchSettings(duration_s=10, warmup_s=0, speedup=2.0))
    starts = sorted(r.start_s for r in result.records)
    # Each request leaves at its timestamp / 2, never earlier (a closed loop would send all three at once); a busy
    # machine may make one late, so lateness is only bounded loosely.
    assert len(starts) == 3 and starts[1] >= 0.5 - 0.01 and starts[2] >= 1.0 - 0.01 and starts[2] < 5
    assert result.duration_s < 8 and result.mode == "trace time x2"  # it ended with the trace, not at 10 s


# -- command line ----------------------------------------------------------------------------------------------
def test_unreachable_target_is_one_line_and_nonzero():
    proc = subprocess.run([sys.executable, "-m", "warmroute", "bench", "--target", "http://127.0.0.1:9",
                           "--duration", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "cannot reach http://127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--workload", "nope"], "unknown workload 'nope'"),
    (["--workload", "trace"], "needs a trace file"),
    (["--trace", "x.jsonl"], "need --workload trace"),
    (["--param", "pool_size"], "KEY=VALUE"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--engine-metrics", "localhost:9"], "not an http(s) URL"),
])
def test_bad_input_exits_2_with_one_line(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert main(["bench", "--target", "http://127.0.0.1:9", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().count("\n") == 0


# -- against the real emulated engine, in process --------------------------------------------------------------
async def test_bench_against_the_emulated_engine():
    from warmroute.engine.model import EngineConfig
    from warmroute.engine.server import start_fleet

    fleet = await start_fleet(1, 0, config=EngineConfig.from_profile("8b", kv_capacity_tokens=50_000),
                              time_scale=0.05)
    try:
        url = fleet.urls[0]
        settings = BenchSettings(concurrency=4, duration_s=1.5, warmup_s=0.5, engine_metrics=[url + "/metrics"])
        result = await run_bench(url, make_workload("shared", max_tokens=4, **SMALL), settings)
    finally:
        await fleet.close()
    s = result.summary()
    # (A host too busy for the engine is said in a warning of its own: the next test.)
    assert s["requests"] > 20 and s["errors"] == {} and not [w for w in s["warnings"] if "behind" not in w]
    assert s["ttft_ms"]["p50"] is not None and s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(4 * s["throughput"]["requests_per_s"], rel=0.05)
    # Four small system prompts, all cached after the warm-up: most prompt tokens hit, by both counts.
    assert s["hit_rate"]["fleet"] > 0.5 and s["hit_rate"]["client"] > 0.5
    assert s["hit_rate"]["fleet"] == pytest.approx(s["hit_rate"]["client"], abs=0.1)


async def test_bench_warns_when_the_emulated_engines_fell_behind_their_modelled_speed():
    from warmroute.engine.model import EngineConfig
    from warmroute.engine.server import start_fleet

    async def stall() -> None:
        """The host too busy for the engine: its event loop held up mid-window, while a long generation keeps the
        engine stepping (an idle engine owes nothing)."""
        body = {"model": "m", "messages": [{"role": "user", "content": "long"}], "max_tokens": 4000}
        async with aiohttp.ClientSession() as http:
            long_run = asyncio.create_task(http.post(fleet.urls[0] + "/v1/chat/completions", json=body))
            await asyncio.sleep(0.8)
            time.sleep(0.4)
            (await long_run).release()

    fleet = await start_fleet(1, 0, config=EngineConfig.from_profile("8b", kv_capacity_tokens=50_000),
                              time_scale=0.05)
    try:
        url = fleet.urls[0]
        settings = BenchSettings(concurrency=4, duration_s=1.5, warmup_s=0.3, engine_metrics=[url + "/metrics"])
        result, _ = await asyncio.gather(run_bench(url, make_workload("shared", max_tokens=4, **SMALL), settings),
                                         stall())
    finally:
        await fleet.close()
    behind = [w for w in result.summary()["warnings"] if "behind their modelled speed" in w]
    assert len(behind) == 1 and "over 1 instance)" in behind[0], result.warnings


# -- the demo --------------------------------------------------------------------------------------------------
def test_demo_sizes_each_cache_to_a_quarter_of_the_working_set():
    from warmroute.bench.demo import engine_tokens_per_estimated_token, plan_for

    w = make_workload("mixed")
    ratio = engine_tokens_per_estimated_token(w)  # the engine's real tokens per ~4-byte estimated token
    assert 0.5 < ratio < 1.0  # the tiny model's BPE makes a token of most of the workload's words
    assert plan_for(w, 16).kv_capacity_tokens == int(w.working_set_tokens(16) * ratio) // 4


def test_demo_rejects_unknown_strategy(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert main(["demo", "--strategies", "fastest"]) == 2
    assert "unknown strategy 'fastest'" in capsys.readouterr().err


def test_demo_runs_a_strategy_and_stops_its_processes(monkeypatch, capsys):
    from warmroute.bench import processes

    started: list[processes.Child] = []
    real_init = processes.Child.__init__

    def recording_init(self, *a, **kw):
        real_init(self, *a, **kw)
        started.append(self)

    monkeypatch.setattr(processes.Child, "__init__", recording_init)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    rc = main(["demo", "--strategies", "cache_aware", "--duration", "1", "--warmup", "0.5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    (result,) = out["results"]
    assert result["label"] == "cache_aware" and result["requests"] > 0
    assert result["hit_rate"]["fleet"] is not None and result["instances"]["requests"]
    # the router's x-warmroute-predicted-hit header met the engine's usage report on every measured request
    assert result["prediction_error_tokens"]["requests"] == result["requests"]
    assert len(started) == 2 and all(c.proc.poll() is not None for c in started)


def test_free_ports_stay_below_the_ephemeral_range_and_skip_taken_ones(monkeypatch, tmp_path):
    """Ports for children come from below the range the kernel gives outgoing connections (which could take a
    port between our check and the child's bind), start where asked, and step over a port already bound."""
    import socket

    from warmroute.bench import processes

    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    monkeypatch.setattr(processes, "_EPHEMERAL_RANGE", ranges)
    port = processes.free_ports(3)
    assert 10000 <= port and port + 3 <= 40000
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        assert processes.free_ports(1, busy) > busy
        assert processes.free_ports(2, busy - 1) >= busy + 1
    assert processes.free_ports(3, 39999) >= 40000  # no room for three below the range: above it, never below start


async def test_requests_still_running_after_the_drain_are_unfinished_errors(fake_engine):
    _, url = await fake_engine(tokens=1000)  # 5 s per request
    result = await run_bench(url, make_workload("shared", **SMALL),
                             BenchSettings(concurrency=2, duration_s=0.3, warmup_s=0, drain_s=0.2))
    assert result.errors == {"unfinished": 2} and not result.ok


def test_the_wait_in_the_router_is_read_from_the_reason_header():
    from warmroute.bench.client import _queued
    assert _queued("cache_hit; match=precise; queued=0.153s") == 0.153
    assert _queued("cold") is None and _queued("cold; queued=soon") is None
