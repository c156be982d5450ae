"""benchmarks/saturation.py in a tiny configuration (warmroute only, no peer), and its machinery's pure parts
(warmroute.bench.saturation).

No timing assertions: only that requests complete, without errors, and that the numbers are well formed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from warmroute.bench import saturation as sat
from warmroute.bench.trivial import start_trivial_fleet

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "saturation.py"


def test_tiny_run_of_both_phases(tmp_path):
    """The script as a user runs it: stub fleet, direct and warmroute, one short round of each phase."""
    argv = ["--contenders", "direct", "warmroute", "--fleets", "stub", "--rounds", "1", "--duration", "1",
            "--warmup", "0.3", "--connections", "8", "--streams", "4", "--stream-tokens", "4", "--itl-ms", "5",
            "--json", str(tmp_path / "sat.json"), "--logs", str(tmp_path / "logs")]
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "sat.json").read_text())

    rows = result["saturation"]["stub"]
    assert set(rows) == {"direct", "warmroute"}
    for row in rows.values():
        assert row["requests"] > 0 and row["rps"] > 0
        assert row["errors"] == 0
        assert row["ratio_to_peer"] is None  # no smg in this run
        assert row["cores"]["load generator"] >= 0
    assert rows["warmroute"]["router_cpu_us_per_request"] is not None

    lat = result["latency"]["warmroute"]
    assert lat["pairs"] > 0 and lat["errors"] == 0
    assert lat["direct_p50"] > 0 and lat["router_p50"] > 0
    assert not result["meta"]["notes"]

    fragment = sat.render_fragment(result)
    assert fragment.startswith(f"## {sat.SECTION}\n")
    assert "| warmroute |" in fragment
    # the summary table's row for (b); none for (a), which needs smg's throughput to compare with
    assert "### Rows for the summary table\n\n| router added latency" in fragment
    assert "| saturation throughput" not in fragment


async def test_trivial_instances_answer_like_an_engine():
    """Plain and streamed answers parse as OpenAI responses; paced streams arrive token by token."""
    servers = await start_trivial_fleet(1, itl_ms=2.0)
    url = servers[0].url
    try:
        async with aiohttp.ClientSession() as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            async with client.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                data = await r.json()
            assert data["choices"][0]["message"]["content"] == "lorem ipsum dolor "
            assert "prompt_tokens_details" not in data["usage"]
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            async with client.post(url + "/v1/completions", json={**stream, "prompt": "x"}) as r:
                events = [line[6:] async for line in r.content if line.startswith(b"data: ")]
            assert events[-1].strip() == b"[DONE]"
            parsed = [json.loads(e) for e in events[:-1]]
            assert "".join(c["choices"][0]["text"] for c in parsed if c["choices"]) == "lorem ipsum dolor "
            assert parsed[-1]["usage"]["completion_tokens"] == 3
            async with client.get(url + "/get_server_info") as r:
                assert (await r.json())["max_running_requests"] > 0
            async with client.get(url + "/nowhere") as r:
                assert r.status == 404
    finally:
        for s in servers:
            await s.close()


async def _exchange(url: str, data: bytes) -> bytes:
    """Write raw bytes to a trivial instance, read until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_trivial_instances_refuse_bad_requests_and_answer_pipelined_ones_in_order():
    servers = await start_trivial_fleet(1)
    url = servers[0].url
    try:
        too_long = await _exchange(url, b"GET /health HTTP/1.1\r\nX: " + b"x" * 70_000 + b"\r\n\r\n")
        assert too_long.startswith(b"HTTP/1.1 400 ") and b"head too large" in too_long
        too_big = await _exchange(url, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n{")
        assert too_big.startswith(b"HTTP/1.1 413 ")
        assert (await _exchange(url, b"NONSENSE\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        both = await _exchange(url, b"GET /health HTTP/1.1\r\n\r\n"
                                    b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert both.startswith(b"HTTP/1.1 200 ") and both.count(b"HTTP/1.1 200 ") == 2
        assert both.endswith(b'"max_model_len":1048576}]}')
    finally:
        for s in servers:
            await s.close()


def test_latency_summary_and_verdict():
    pairs = [(0.001, 0.0015)] * 99 + [(0.002, 0.006)]
    s = sat.latency_summary(pairs)
    assert s["pairs"] == 100
    assert s["added_p50"] == pytest.approx(0.5)
    assert s["paired_p50"] == pytest.approx(0.5)
    assert s["router_p99"] > s["direct_p99"]
    assert sat.latency_met(s) is (s["added_p99"] <= sat.TARGET_P99_MS)
    assert sat.latency_met({}) is None


def test_saturation_ratios_are_taken_within_a_round():
    def w(label, r, rps):
        return {"contender": label, "round": r, "rps": rps, "requests": int(rps), "errors": {},
                "latency_ms": {"p50": 1.0, "p99": 2.0}, "cpu_cores": {"instances": 0.1, "load generator": 0.1,
                                                                       label: 0.5, "machine": 1.0}}
    rows = sat.saturation_summary([w("smg", 0, 100), w("warmroute", 0, 50), w("smg", 1, 200), w("warmroute", 1, 150)])
    assert rows["warmroute"]["ratio_to_peer"] == pytest.approx((0.5 + 0.75) / 2)
    assert rows["smg"]["ratio_to_peer"] == 1.0
    assert rows["warmroute"]["rps"] == 100


def test_fragment_ends_with_the_summary_rows():
    sat_rows = {"stub": {"smg": {"rps": 100.0, "ratio_to_peer": 1.0, "router_cpu_us_per_request": 50.0},
                         "warmroute": {"rps": 150.0, "ratio_to_peer": 1.5, "router_cpu_us_per_request": 40.0,
                                       "per_core_ratio_to_peer": 1.25}}}
    rows = sat.summary_rows(sat_rows, {})
    assert list(rows) == ["| saturation throughput"]
    assert "warmroute 150 (1.50×)" in rows["| saturation throughput"] and rows["| saturation throughput"].endswith(
        "| met |")


def test_round_orders_alternate():
    cs = sat.CONTENDERS[:3]
    orders = sat.round_orders(cs, 3)
    assert orders[0] == cs and orders[1] == list(reversed(cs)) and orders[2] == cs
