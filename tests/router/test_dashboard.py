"""The live status page: /dashboard/state's content (and what it must never contain), /livez, and the page
itself rendered by headless Chromium (skipped, with the reason, where Chromium is not installed)."""

from __future__ import annotations

import asyncio
import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import aiohttp
import pytest

from fake_upstream import Upstream, answer_json
from warmroute.router import dashboard
from warmroute.router.dashboard import HOT_SLOTS, Activity, Timeline, TimelineSampler
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

SECRET_TEXT = "confidential-system-prompt-XYZZY"


# A chat completion with a usage report (half the prompt cached).
ANSWER = answer_json({"choices": [{"message": {"role": "assistant", "content": "hi"}}],
                      "usage": {"prompt_tokens": 400, "completion_tokens": 1,
                                "prompt_tokens_details": {"cached_tokens": 200}}})


async def _engine(name: str) -> Upstream:
    engine = await Upstream(name, models=None).start()
    engine.behaviour = ANSWER
    return engine


@pytest.fixture
async def router_with_traffic():
    engines = [await _engine(f"gpu-{i}") for i in range(3)]
    router = await start_router(load_settings({
        "backends": [f"{e.name}={e.url}" for e in engines], "port": 0, "health_interval": 3600,
        "engine_metrics": False}, env={}))
    async with aiohttp.ClientSession() as client:
        for i in range(24):  # one hot shared prefix (3 in 4 requests) and a tail of unique ones
            head = SECRET_TEXT * 40 if i % 4 else f"unique {i} " * 200
            body = {"model": "m", "messages": [{"role": "system", "content": head},
                                               {"role": "user", "content": f"question {i}"}]}
            async with client.post(router.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
    yield router, engines
    await router.stop()
    for e in engines:
        await e.stop()


async def test_state_shows_instances_hit_rates_hot_prefixes_and_decisions(router_with_traffic):
    router, engines = router_with_traffic
    async with aiohttp.ClientSession() as client:
        async with client.get(router.url + "/dashboard/state") as r:
            assert r.status == 200
            text = await r.text()
        async with client.get(router.url + "/dashboard") as r:
            assert r.status == 200 and r.content_type == "text/html"
            page = await r.text()
    state = json.loads(text)
    assert [i["name"] for i in state["instances"]] == ["gpu-0", "gpu-1", "gpu-2"]
    assert sum(i["requests"] for i in state["instances"]) == 24
    assert all(i["healthy"] and not i["draining"] for i in state["instances"])
    assert state["hit_rate"]["engine_reported"] == pytest.approx(0.5)
    assert 0 <= state["hit_rate"]["predicted"] <= 1
    hot = state["hot_prefixes"]
    assert hot[0]["share"] == pytest.approx(18 / 24, abs=0.01)  # the shared system prompt
    assert len(state["recent_decisions"]) == 24
    assert {d["instance"] for d in state["recent_decisions"]} <= {"gpu-0", "gpu-1", "gpu-2"}
    assert all(d["reason"] for d in state["recent_decisions"])
    # never prompt text, never addresses
    for needle in (SECRET_TEXT, "question", "127.0.0.1", *(str(e.port) for e in engines)):
        assert needle not in text, needle
    assert "fetch(" in page and "dashboard/state" in page


async def test_livez_answers_even_with_every_engine_down():
    router = await start_router(load_settings({"backends": ["dead=http://127.0.0.1:9"], "port": 0,
                                               "health_interval": 3600, "engine_metrics": False}, env={}))
    try:
        async with aiohttp.ClientSession() as client:
            async with client.get(router.url + "/health") as r:
                assert r.status == 503
            async with client.get(router.url + "/livez") as r:
                assert r.status == 200 and (await r.json())["status"] == "alive"
    finally:
        await router.stop()


async def test_dashboard_can_be_turned_off():
    router = await start_router(load_settings({"backends": ["a=http://127.0.0.1:9"], "port": 0, "dashboard": False,
                                               "health_interval": 3600, "engine_metrics": False}, env={}))
    try:
        assert not any(r.resource and r.resource.canonical.startswith("/dashboard")
                       for r in router.app.router.routes())
    finally:
        await router.stop()


def test_hot_prefix_counter_stays_bounded():
    from warmroute.core.routing_key import key_for_raw
    from warmroute.core.strategies import Decision

    activity = Activity(64)
    for i in range(HOT_SLOTS * 20):
        data = b"hot" * 400 if i % 2 else f"cold-{i}-".encode() * 200
        activity.note(key_for_raw(data), Decision("a", "cold", prompt_tokens=10))
    assert HOT_SLOTS // 2 < len(activity._counts) <= HOT_SLOTS
    top = activity.hot()[0]
    assert top["share"] >= 0.5 and len(top["prefix"]) == 12  # a keyed hash, never the text
    assert len(activity.recent) <= 30


def test_state_adds_the_other_workers_snapshots():
    """Worker A's page with worker B's snapshot (as it travels: JSON bytes) shows both workers' traffic; a
    malformed or stale snapshot is left out."""
    from warmroute.core.fleet import Fleet
    from warmroute.core.routing_key import key_for_raw
    from warmroute.core.strategies import Decision
    from warmroute.router.dashboard import Siblings, snapshot, state
    from warmroute.router.metrics import Metrics

    def worker(requests: list[bytes]) -> tuple[Fleet, Activity, Metrics]:
        fleet, activity, metrics = Fleet(), Activity(64), Metrics("cache_aware", ["a", "b"])
        for name in ("a", "b"):
            fleet.add(name)
        for i, data in enumerate(requests):
            name = "ab"[i % 2]
            fleet.dispatched(name, 10, prompt_tokens=100 * (i + 1))
            activity.note(key_for_raw(data), Decision(name, "cold", matched_tokens=5, prompt_tokens=10))
        return fleet, activity, metrics

    hot, cold = b"hot" * 400, b"cold" * 400
    a, b = worker([hot] * 3), worker([hot, cold, cold, cold, cold])
    siblings = Siblings()
    siblings.receive(json.dumps(snapshot(*b)).encode())
    siblings.receive(b"not json")  # ignored
    siblings.receive(b'{"no pid": 1}')  # ignored
    siblings.receive(b'{"pid": 7}')  # incomplete: ignored
    siblings.receive(b'[1, 2]')  # not an object: ignored
    merged = state(*a, "cache_aware", siblings.fresh())
    alone = state(*a, "cache_aware")
    assert merged["workers"] == 2 and alone["workers"] == 1
    assert [i["requests"] for i in merged["instances"]] == [2 + 3, 1 + 2]  # a, b over both workers
    assert [i["inflight"] for i in merged["instances"]] == [5, 3]
    # prompt tokens in flight: worker a sent 100, 200, 300 (a, b, a); worker b 100..500 (a, b, a, b, a)
    assert [i["inflight_prompt_tokens"] for i in merged["instances"]] == [100 + 300 + 100 + 300 + 500, 200 + 200 + 400]
    cap = a[0].instances["a"].kv_capacity_tokens
    assert [i["kv_demand"] for i in merged["instances"]] == [round(1300 / cap, 4), round(800 / cap, 4)]
    assert len(merged["recent_decisions"]) == 8 and merged["hit_rate"]["predicted"] == 0.5
    assert [p["share"] for p in merged["hot_prefixes"]] == [0.5, 0.5]  # hot 4 of 8, cold 4 of 8
    assert [p["share"] for p in alone["hot_prefixes"]] == [1.0]
    assert alone["hot_prefixes"][0]["prefix"] in [p["prefix"] for p in merged["hot_prefixes"]]  # labelled alike
    # the charts' sampler reads both workers too: in flight summed per instance
    timeline = Timeline(interval=1.0)
    sampler = TimelineSampler(timeline, *a, siblings, None)
    for _ in range(2):
        asyncio.run(sampler.round())
    assert timeline.series()["inflight"] == {"a": [5], "b": [3]}
    assert state(*a, "cache_aware", siblings.fresh(), timeline=timeline)["series"]["inflight"] == {"a": [5], "b": [3]}


def test_state_shows_the_admission_queue_of_every_worker():
    """Who waits in the router, by priority and tenant (this worker's queue plus the others' snapshots), and
    the admitted and refused counts."""
    from warmroute.core.admission import Admission, AdmissionSettings
    from warmroute.core.fleet import Fleet
    from warmroute.core.strategies import Decision
    from warmroute.router.dashboard import snapshot, state
    from warmroute.router.metrics import Metrics

    def worker(waiting: list[tuple[int, str]]) -> tuple[Fleet, Activity, Metrics, Admission]:
        fleet, metrics = Fleet(), Metrics("cache_aware", ["a"])
        fleet.add("a", engine_capacity=1).inflight = 1  # its engine full
        adm = Admission(AdmissionSettings(concurrency_threshold=1), fleet)
        for priority, tenant in waiting:
            adm.offer(adm.waiter_for(Decision("a", "cold"), 0.0, priority, tenant))
        metrics.admitted("engine_full")
        metrics.left_queue(0, "t", 1.0, "deadline")
        return fleet, Activity(64), metrics, adm

    a, b = worker([(0, "t"), (0, "t"), (5, "vip")]), worker([(0, "t")])
    other = json.loads(json.dumps(snapshot(*b)))
    fleet, activity, metrics, adm = a
    q = state(fleet, activity, metrics, "cache_aware", [other], adm)["queue"]
    assert q["enabled"] and q["waiting"] == 4
    assert q["by"] == [{"priority": 5, "tenant": "vip", "waiting": 1}, {"priority": 0, "tenant": "t", "waiting": 3}]
    assert q["admitted"] == {"engine_full": 1.0} and q["shed"] == {"deadline": 1.0}
    assert state(fleet, activity, metrics, "cache_aware")["queue"]["enabled"] is False  # no queue given


def test_timeline_turns_counters_into_rates_in_a_bounded_ring():
    """Each point: the rates since the previous sample (the first sample is only a baseline), summed over this
    worker and the others' snapshots; a worker that restarts is a baseline again, never a drop; the ring keeps
    window / interval points whatever the traffic."""
    import os

    bounds = [0.1, 1.0]

    def totals(n: float, cached: float, ttft: tuple[float, float, float], refused: float = 0.0) -> dict:
        return {"engine_prompt": 100 * n, "engine_cached": cached, "predicted_same": 0.0, "answered": n,
                "refused": refused, "predicted": 50 * n, "asked": 100 * n, "ttft_le": bounds, "ttft": list(ttft)}

    timeline = Timeline(interval=2.0, window=10.0)
    other = {"pid": os.getpid() + 1}
    timeline.sample(totals(0, 0, (0, 0, 0)), {"a": 0}, 0, [other | {"totals": totals(5, 0, (0, 0, 0))}], now=100.0)
    assert timeline.series()["t"] == []  # a baseline only
    # this worker: 10 answers (2 refused), 4 under 0.1 s and 6 under 1 s; the other: 10 answers, all under 0.1 s
    timeline.sample(totals(10, 500, (4, 10, 10), refused=2), {"a": 3}, 7,
                    [other | {"totals": totals(15, 1000, (10, 10, 10))}], now=102.0)
    s = timeline.series()
    assert s["t"] == [102.0] and s["requests_per_s"] == [10.0] and s["refused_per_s"] == [1.0]
    assert s["hit_predicted"] == [0.5] and s["hit_engine"] == [0.75]  # 1500 cached of 2000 prompt tokens
    assert s["ttft_p50_s"] == [round(0.1 * 10 / 14, 4)]  # rank 10 of 20, within the 14 under 0.1 s
    assert s["ttft_p99_s"] == pytest.approx([0.1 + 0.9 * (19.8 - 14) / 6], abs=1e-4)
    assert s["queue_waiting"] == [7] and s["inflight"] == {"a": [3]}
    # the other worker restarted (its counters went back): left out of this point, not a negative rate
    timeline.sample(totals(12, 500, (4, 12, 12), refused=2), {"a": 1}, 0,
                    [other | {"totals": totals(1, 0, (1, 1, 1))}], now=104.0)
    assert timeline.series()["requests_per_s"][-1] == 1.0 and timeline.series()["hit_engine"][-1] == 0.0
    for i in range(100):
        timeline.sample(totals(12 + i, 500, (4, 12 + i, 12 + i), refused=2), {"a": 0}, 0, now=106.0 + 2 * i)
    s = timeline.series()
    assert len(s["t"]) == 5 and s["window_s"] == 10.0 and s["ttft_p50_s"][-1] == pytest.approx(0.55)
    timeline.sample(totals(111, 500, (4, 111, 111), refused=2), {"a": 0}, 0, now=400.0)  # nothing answered since
    s = timeline.series()
    assert s["requests_per_s"][-1] == 0.0 and s["hit_engine"][-1] is None and s["ttft_p99_s"][-1] is None  # gaps
    assert len(timeline._last) == 1  # the gone worker is forgotten


def test_timeline_draws_the_busiest_instances_and_sums_the_rest():
    timeline = Timeline(interval=1.0)
    zero = {"engine_prompt": 0, "engine_cached": 0, "answered": 0, "refused": 0, "predicted": 0, "asked": 0,
            "ttft_le": [1.0], "ttft": [0, 0]}
    for now in (1.0, 2.0, 3.0):
        timeline.sample(zero, {f"i{k:02d}": k for k in range(dashboard.INSTANCE_LINES + 3)}, 0, now=now)
    inflight = timeline.series()["inflight"]
    assert list(inflight) == [f"i{k:02d}" for k in range(3, dashboard.INSTANCE_LINES + 3)] + ["others"]
    assert inflight["others"] == [0 + 1 + 2] * 2


# -- in a real browser ---------------------------------------------------------------------------------------
def chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


async def run_chromium(binary: str, tmp: Path, *args: str) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={tmp}",
        "--window-size=1200,900", "--virtual-time-budget=3000", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, f"chromium exited with {proc.returncode}"
    return out


async def test_page_renders_live_state_in_headless_chromium(router_with_traffic, tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    router, _ = router_with_traffic
    url = router.url + "/dashboard"
    dom = (await run_chromium(binary, tmp_path / "profile-dom", "--dump-dom", url)).decode()
    # filled in by the page's JavaScript from /dashboard/state, not present in the served HTML
    for name in ("gpu-0", "gpu-1", "gpu-2"):
        assert name in dom
    assert "50.0%" in dom  # the engine-reported hit rate
    assert "healthy" in dom and "strategy cache_aware" in dom and "KV demand" in dom

    shot = tmp_path / "dashboard.png"
    await run_chromium(binary, tmp_path / "profile-shot", f"--screenshot={shot}", url)
    from PIL import Image

    with Image.open(shot) as img:
        assert img.size == (1200, 900)
        gray = img.convert("L")
        colours = len(img.convert("RGB").getcolors(maxcolors=1 << 24) or ())
        lo, hi = gray.getextrema()
    assert colours > 20 and hi - lo > 100, "the screenshot is blank"


class _Lines(HTMLParser):
    """From the rendered DOM: each chart's drawn lines (data-series name -> points)."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: dict[str, dict[str, int]] = {}
        self._chart: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "svg" and a.get("data-chart"):
            self._chart = a["data-chart"]
            self.charts.setdefault(self._chart, {})
        elif tag == "polyline" and self._chart is not None:
            self.charts[self._chart][a["data-series"]] = len(a["points"].split())

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._chart = None


async def test_charts_draw_the_router_s_recent_history_in_headless_chromium(tmp_path, monkeypatch):
    """A router in front of stand-in engines (one full engine at a time each, so requests wait in the router; one
    engine refuses every third request), traffic over several sample intervals, then the page in Chromium:
    every chart has a line of more than one point."""
    binary = chromium()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    monkeypatch.setattr(dashboard, "SAMPLE_EVERY_S", 0.2)
    engines = [await _engine(f"gpu-{i}") for i in range(3)]
    answered = 0

    async def sometimes_refused(request):
        nonlocal answered
        answered += 1
        return await (answer_json({"error": "busy"}, 429) if answered % 3 == 0 else ANSWER)(request)

    engines[2].behaviour = sometimes_refused
    for e in engines:
        e.delay = 0.05
    router = await start_router(load_settings({
        "backends": [f"{e.name}={e.url}" for e in engines], "port": 0, "health_interval": 3600,
        "engine_metrics": False, "engine_capacity": 1}, env={}))
    try:
        async with aiohttp.ClientSession() as client:
            async def one(i: int) -> int:
                body = {"model": "m", "messages": [{"role": "system", "content": SECRET_TEXT * (20 + i % 5)},
                                                   {"role": "user", "content": f"question {i}"}]}
                async with client.post(router.url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    return r.status

            statuses = []
            for burst in range(8):  # about 1.5 s: several points
                statuses += await asyncio.gather(*(one(10 * burst + i) for i in range(10)))
                await asyncio.sleep(0.1)
            assert 429 in statuses and 200 in statuses
            async with client.get(router.url + "/dashboard/state") as r:
                series = (await r.json())["series"]
        assert len(series["t"]) > 2 and max(series["queue_waiting"]) > 0 and max(series["refused_per_s"]) > 0
        assert SECRET_TEXT not in json.dumps(series)

        url = router.url + "/dashboard"
        dom = (await run_chromium(binary, tmp_path / "profile-dom", "--dump-dom", url)).decode()
        lines = _Lines()
        lines.feed(dom)
        expected = {"hit": {"predicted", "engine-reported"}, "ttft": {"p50", "p99"}, "throughput": {"requests"},
                    "queue": {"waiting"}, "refused": {"429s"}, "inflight": {"gpu-0", "gpu-1", "gpu-2"}}
        assert {chart: set(drawn) for chart, drawn in lines.charts.items()} == expected
        for chart, drawn in lines.charts.items():
            assert all(points > 1 for points in drawn.values()), (chart, drawn)
        assert "gpu-0" in dom and SECRET_TEXT not in dom

        shot = tmp_path / "charts.png"
        await run_chromium(binary, tmp_path / "profile-shot", f"--screenshot={shot}", url)
        assert shot.stat().st_size > 10_000
    finally:
        await router.stop()
        for e in engines:
            await e.stop()
