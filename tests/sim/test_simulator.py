import json
import subprocess
import sys

import pytest

from warmroute.core.strategies import CacheAwareSettings, StrategySettings
from warmroute.sim.report import summarize, table
from warmroute.sim.simulator import SimSettings, Simulation
from warmroute.workloads.registry import make_workload


def small(**kw) -> SimSettings:
    base = dict(instances=4, requests=1500, rate=8.0, kv_capacity_tokens=30_000, max_running=32, seed=1)
    return SimSettings(**{**base, **kw})


def run(strategy: str, workload: str = "mixed", **kw):
    return Simulation(small(**kw), make_workload(workload, seed=1), strategy, pooled=strategy == "pooled").run()


def test_same_seed_same_result():
    a, b = run("cache_aware"), run("cache_aware")
    assert [(r.instance, r.first_token) for r in a.records] == [(r.instance, r.first_token) for r in b.records]


def test_every_request_is_served_once():
    r = run("cache_aware")
    assert len(r.records) == 1500 and all(x.done is not None and x.first_token is not None for x in r.records)
    assert sum(r.requests_per_instance.values()) == 1500
    assert all(x.arrival <= x.first_token <= x.done for x in r.records)


def test_the_books_follow_the_kv_demand_in_flight_and_balance_at_the_end():
    """The fleet's in-flight prompt tokens per instance are, at every arrival, the KV tokens (Decision.kv_tokens:
    the whole prompt of a private continuation, the uncached part of any other) of the requests sent there that
    are not done yet (from the simulator's own records), and all of them leave the books."""
    sim = Simulation(small(requests=600), make_workload("mixed", seed=1), "cache_aware")
    choose, checked = sim.strategy.choose, []

    def checking(key, fleet):
        for name, inst in fleet.instances.items():
            live = sum(life.leg.kv_tokens for rec, life in sim._inflight.values()
                       if rec.instance == name and rec.done is None)
            checked.append((inst.inflight_prompt_tokens, live))
        seen.append(choose(key, fleet))
        return seen[-1]

    seen: list = []
    sim.strategy.choose = checking
    sim.run()
    assert len(checked) == 600 * 4 and all(books == live for books, live in checked)
    assert any(d.private and d.kv_tokens == d.prompt_tokens for d in seen)  # both kinds were counted
    assert any(not d.private and 0 < d.kv_tokens < d.prompt_tokens for d in seen)
    assert sum(live > 0 for _, live in checked) > 100  # requests were in flight at many arrivals
    assert all(i.inflight_prompt_tokens == 0 and i.inflight == 0 for i in sim.fleet.instances.values())


def test_strategy_ordering_on_a_cache_constrained_fleet():
    """The caches hold about a quarter of the working set each: routing decides the hit rate."""
    hits = {s: run(s).hit_rate for s in ("random", "prefix", "cache_aware", "oracle", "pooled")}
    assert hits["random"] < hits["prefix"] <= hits["cache_aware"] + 0.02
    assert hits["cache_aware"] >= 0.95 * hits["oracle"]
    assert hits["pooled"] >= max(hits["random"], hits["prefix"])
    assert hits["cache_aware"] >= 2 * hits["random"]


def test_cache_aware_answers_sooner_than_random():
    rand, ca = summarize(run("random")), summarize(run("cache_aware"))
    assert ca.ttft_p50_ms < rand.ttft_p50_ms and ca.ttft_p99_ms < rand.ttft_p99_ms


@pytest.mark.parametrize("seed", [0, 1])
def test_hot_prompt_under_load_is_spread_not_pinned(seed):
    """60% of requests share one prompt and the fleet is busy (32 req/s on 4 instances): cache_aware keeps
    per-instance request counts near the mean (measured 1.22 and 1.24 for these seeds, 1.28 and 1.26 before
    the guard for hot prefixes; issue #2 asks for 1.3) where the reference's prefix routing pins the hot prompt
    to one instance (2.2-2.5)."""
    def spread_of(strategy: str, **kw) -> float:
        settings = small(rate=32.0, requests=4000, seed=seed, **kw)
        return summarize(Simulation(settings, make_workload("hot", seed=seed), strategy).run()).load_spread

    # prefix as the reference router runs it: spilling along its own order, with no admission queue in front
    spread = {"cache_aware": spread_of("cache_aware"),
              "prefix": spread_of("prefix", routing=StrategySettings(admission=False))}
    assert spread["cache_aware"] <= 1.35 and spread["prefix"] > 2


@pytest.mark.parametrize("seed", [0, 1])
def test_hot_prompt_on_small_caches_is_copied_not_concentrated(seed):
    """The HTTP peer comparison's hot case (16 clients, caches of 10k tokens): the hot prompt's holders are
    fast, so one miss weight of 2 kept it on a few of them and their request counts reached 1.6x the mean.
    A prefix several instances hold is costed at its own TTFT (α = 1) and spreads (measured 1.11 and 1.16;
    1.08 and 1.04 with the guard for hot prefixes)."""
    settings = SimSettings(instances=4, requests=2000, concurrency=16, kv_capacity_tokens=10240, max_running=8,
                           seed=seed)
    r = summarize(Simulation(settings, make_workload("hot", seed=seed, hot=0.6, max_tokens=2), "cache_aware").run())
    assert r.load_spread <= 1.3 and r.hit_rate > 0.75


@pytest.mark.parametrize("rate", [20.0, 25.0])
def test_hot_prompt_at_a_fixed_rate_is_spread_by_its_popularity(rate):
    """At a load where queues stay short, every hot-prompt request is cheapest on the instances that already
    hold it, so the cost rule alone kept it on two of four (request counts 1.4-1.6x the mean). The guard for
    hot prefixes copies it further (1.20-1.25 measured over six seeds), at nearly the same hit rate: its copies
    cost 0-1.5 points over seeds 1-3 at both rates with the engine's vLLM-like free queue, which evicts a cached
    block when it reaches the queue's front even while empty blocks wait behind it (0-0.6 points with the
    earlier cache model, which evicted only when no empty block was left). The guard is compared on its own (no
    holding in the router: unguarded, a hot prompt's holders fill up and holding then changes that variant);
    with the shipped settings holding changes next to nothing here."""
    settings = SimSettings(instances=4, requests=3000, rate=rate, kv_capacity_tokens=10240, max_running=8, seed=1,
                           routing=StrategySettings(hold_kv_limit=1000.0))
    workload = lambda: make_workload("hot", seed=1, hot=0.6, max_tokens=2)  # noqa: E731
    guarded = Simulation(settings, workload(), "cache_aware")
    unguarded = Simulation(settings.changed("hot_balance_factor", 1000.0), workload(), "cache_aware")
    shipped = Simulation(settings.changed("hold_kv_limit", CacheAwareSettings().hold_kv_limit), workload(), "cache_aware")
    on, off, as_shipped = summarize(guarded.run()), summarize(unguarded.run()), summarize(shipped.run())
    assert on.load_spread <= 1.3 < off.load_spread
    assert on.hit_rate > off.hit_rate - 0.02
    assert as_shipped.hit_rate == pytest.approx(on.hit_rate, abs=0.002)
    assert as_shipped.ttft_p99_ms == pytest.approx(on.ttft_p99_ms, rel=0.02)


def test_hot_prompt_ttft_under_a_fixed_rate_stays_at_the_engines_floor():
    """The hot workload offered at a fixed rate near a prefix-affinity router's capacity (docs/benchmarks.md, "The
    hot prompt's TTFT"): cache_aware's hot-prompt TTFT p50 stays at one prefill step of an idle engine (40 ms on
    the 8b profile: 30 ms fixed + the question's tokens), the SGLang-like model's does not; the per-class figures
    come from the summary's `ttft_p50_ms_by_class`."""
    settings = SimSettings(instances=4, requests=2000, rate=25.0, kv_capacity_tokens=10240, max_running=8, seed=0)
    got = {s: summarize(Simulation(settings, make_workload("hot", seed=0, hot=0.6, max_tokens=2), s).run())
           for s in ("cache_aware", "sglang_like")}
    ours, theirs = (got[s].ttft_p50_ms_by_class for s in ("cache_aware", "sglang_like"))
    assert set(ours) == {"hot", "shared"}
    assert ours["hot"] < 45 and ours["hot"] <= 0.6 * theirs["hot"]


def test_closed_loop_keeps_the_concurrency():
    r = run("cache_aware", rate=None, concurrency=6, requests=600)
    events = sorted([(x.arrival, 1) for x in r.records] + [(x.done, -1) for x in r.records])
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak <= 6 and len(r.records) == 600


def test_multi_turn_turns_run_in_order():
    r = run("cache_aware", workload="chat", requests=400)
    assert len(r.records) >= 400


def test_scale_up_moves_about_one_over_n_plus_one_of_prefixes():
    r = run("prefix", workload="shared", requests=3000, scale_events=[(150.0, +1)],
            instances=7)
    (t, moved), = r.prefixes_moved
    assert t == 150.0 and abs(moved - 1 / 8) < 0.08
    assert "instance-7" in r.requests_per_instance and r.requests_per_instance["instance-7"] > 0
    s = summarize(r)
    assert s.hit_rate_dips[0]["before"] is not None
    assert "went to another instance" in table([s])


def test_moved_prefixes_and_the_dip_are_measured_per_strategy_from_its_decisions():
    """Issue #22 item 13: the share of prefixes moved by a scale event came from where rendezvous would place each
    prefix cold (the same for every strategy), and 'recovered in 10 s' was printed without any dip."""
    by = {name: run(name, workload="shared", requests=3000, scale_events=[(150.0, +1)], instances=7)
          for name in ("prefix", "random")}
    (_, prefix_moved), = by["prefix"].prefixes_moved
    (_, random_moved), = by["random"].prefixes_moved
    assert random_moved > 0.6 > 0.3 > prefix_moved  # random scatters a prefix whatever the fleet does
    dip = summarize(by["random"]).hit_rate_dips[0]
    line = next(ln for ln in table([summarize(by["random"])]).splitlines() if "scale event" in ln)
    if dip["lowest"] >= 0.95 * dip["before"]:
        assert dip["recovery_s"] == 0.0 and "no dip" in line and "recovered in" not in line
    else:
        assert "no dip" not in line


def test_no_dip_is_said_as_such():
    from warmroute.sim.report import _dip
    from warmroute.sim.simulator import RequestRecord, SimResult

    records = [RequestRecord(float(t), "instance-0", 100, "cache_hit", sent=float(t)) for t in range(0, 60)]
    for r in records:
        r.first_token, r.done, r.cached_tokens, r.prompt_tokens = r.arrival + 0.1, r.arrival + 0.2, 80, 100
    result = SimResult("cache_aware", records, 60.0, {"instance-0": 60}, 0, 0, 0, [(30.0, 0.0)], 10.0)
    assert _dip(result, 30.0)["recovery_s"] == 0.0  # a flat hit rate: it never dipped, nothing to recover from


def test_scale_down_drains_the_removed_instance():
    r = run("cache_aware", requests=2000, scale_events=[(100.0, -1)])
    removed = [x for x in r.records if x.instance == "instance-3"]
    assert removed and all(x.arrival < 100.0 for x in removed)
    assert all(x.done is not None for x in r.records)


def test_engine_feedback_recovers_a_misconfigured_kv_capacity():
    """The router believes each cache 4x smaller / larger than it is (docs/feedback.md measures it at length)."""
    correct = run("cache_aware", feedback=False).hit_rate
    for wrong in (7_500, 120_000):
        assert run("cache_aware", router_kv_capacity_tokens=wrong).hit_rate >= 0.9 * correct
    assert run("cache_aware", router_kv_capacity_tokens=7_500, feedback=False).hit_rate < 0.75 * correct


@pytest.mark.parametrize("args, needle", [
    (["--prefix-length", "10"], "--prefix-length"),
    (["--concurrency-threshold", "0"], "--concurrency-threshold"),
    (["--strategies", "random,fastest"], "unknown strategy"),
    (["--scale-at", "ten:+1"], "--scale-at"),
    (["--sweep", "colour=1,2"], "--sweep"),
    (["--router-kv-capacity-tokens", "10"], "--router-kv-capacity-tokens"),
    (["--hot-balance-factor", "-1"], "--hot-balance-factor"),
    (["--workload", "nope"], "unknown workload"),
    (["--workload", "trace", "--trace", "/nonexistent.jsonl"], "cannot read trace"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    p = subprocess.run([sys.executable, "-m", "warmroute", "simulate", "--requests", "10", *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_cli_sweep_reports_the_winner():
    p = subprocess.run([sys.executable, "-m", "warmroute", "simulate", "--workload", "shared", "--requests", "300",
                        "--instances", "3", "--rate", "4", "--strategies", "prefix,cache_aware",
                        "--sweep", "prefix_length=1024,8192"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "prefix_length=1024" in p.stdout and "prefix_length=8192" in p.stdout
    assert "best setting for cache_aware by TTFT p50: prefix_length=" in p.stdout


def test_cli_sweeps_the_hot_prefix_guard():
    p = subprocess.run([sys.executable, "-m", "warmroute", "simulate", "--workload", "hot", "--param", "hot=0.6",
                        "--instances", "4", "--kv-capacity-tokens", "10240", "--max-running", "8", "--max-tokens",
                        "2", "--rate", "25", "--requests", "2000", "--strategies", "cache_aware", "--json",
                        "--sweep", "hot_balance_factor=0.2,1000"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    spread = {r["setting"]: r["results"][0]["load_spread"] for r in json.loads(p.stdout)}
    assert spread["hot_balance_factor=0.2"] <= 1.3 < spread["hot_balance_factor=1000.0"]


@pytest.mark.parametrize("seed", [0, 1])
def test_long_chats_keep_their_history_warm_like_sticky_routing(seed):
    """32 closed-loop chats (6-12 turns, 300-token replies) on 4 instances whose caches about hold the working
    set: the HTTP comparison's chat case (docs/peers.md). cache_aware must keep conversations where their
    history is. Measured: 54.5% and 59.5% against the SGLang-like reference's 59.8% and 63.7%; before the
    private-prefix miss weight and the refresh at finish it was 42.7-44.5% at 3,000 requests."""
    settings = SimSettings(instances=4, kv_capacity_tokens=13312, max_running=8, concurrency=32, requests=1500,
                           seed=seed)
    workload = make_workload("chat", seed=seed, max_tokens=2, min_turns=6, max_turns=12, reply_tokens=300)
    hit = {s: summarize(Simulation(settings, workload, s).run()).hit_rate for s in ("cache_aware", "sglang_like")}
    assert hit["cache_aware"] >= 0.5 and hit["cache_aware"] >= 0.85 * hit["sglang_like"]


def test_a_scenario_row_with_no_finished_request_prints_a_dash():
    """Issue #22 item 14: a missing TTFT p50 (nothing finished) used to raise TypeError in the row's format."""
    import dataclasses

    from warmroute.sim.cli import _scenario_row
    from warmroute.sim.report import Summary

    empty = Summary(strategy="random", requests=3, ttft_p50_ms=None, ttft_p99_ms=None, e2e_p50_s=None,
                    throughput_rps=0.0, output_tokens_per_s=0.0, hit_rate=0.0, load_spread=None, spilled=0.0,
                    rejected=0, prefixes_moved=[], hit_rate_dips=[], ttft_p50_ms_by_class={})
    row = _scenario_row("c1", {"random": empty, "cache_aware": dataclasses.replace(empty, strategy="cache_aware")})
    assert "random: hit 0% p50 -ms" in row and "cache_aware: hit 0% p50 -ms" in row


def test_a_prefill_budget_holds_the_noisy_tenant_and_the_books_return_to_zero():
    """Two tenants on two instances, one at 20x the other's rate, with prefill_budget 256: some requests wait in
    the router for their instance's prefill to drain (why PREFILL), every request sent is answered, and the
    queue's books (slots, tenants, prefill tokens: a tenant alone again is not held) are back to zero at the end."""
    from warmroute.core.admission import PREFILL
    from warmroute.workloads.tenants import Tenants, TenantStream

    workload = Tenants(seed=1, duration_s=20.0, streams=(TenantStream("quiet", make_workload("mixed", seed=1), 2.0),
                                                         TenantStream("noisy", make_workload("mixed", seed=2), 40.0)))
    settings = SimSettings(instances=2, max_running=64, requests=10**6, seed=1,
                           routing=StrategySettings(concurrency_threshold=16))
    sim = Simulation(settings, workload, "cache_aware")
    sim.admission.settings.prefill_budget = 256
    whys = []
    offer = sim.admission.offer
    sim.admission.offer = lambda w: (whys.append(w.why), offer(w))[1]
    res = sim.run()
    assert PREFILL in whys and all(x.done is not None for x in res.records)
    adm = sim.admission
    assert adm.idle() and not adm.active_tenants
    adm.started("noisy", "instance-0", 10_000)  # alone, past the budget: the next goes at once
    assert adm.capped("noisy", sim.fleet.instances["instance-0"]) is None
    adm.started("quiet", "instance-1")
    # Two tenants active: noisy asked for 20x quiet's requests lately, past its share: held at instance-0, past the
    # budget; quiet, asking for less than its share and with nothing of its own queued there, is not.
    assert adm.capped("noisy", sim.fleet.instances["instance-0"]) == PREFILL
    assert adm.capped("quiet", sim.fleet.instances["instance-0"]) is None


def test_cli_simulates_a_strategy_defined_in_a_config_file(tmp_path):
    """`--config` brings a router config's strategies (and strategy settings) to the simulator."""
    config = tmp_path / "router.yaml"
    config.write_text("backends: [http://127.0.0.1:9]\nprefix_length: 2048\nstrategies:\n"
                      "  mine: {stages: [prefix_match, load_guard, scorers, tie_slack, least_loaded_ties, rendezvous]}\n"
                      "  sticky: {base: cache_aware, settings: {miss_weight: 32}}\n")
    p = subprocess.run([sys.executable, "-m", "warmroute", "simulate", "--workload", "shared", "--requests", "200",
                        "--instances", "3", "--rate", "4", "--config", str(config), "--strategies",
                        "cache_aware,mine,sticky", "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert [r["strategy"] for r in json.loads(p.stdout)[0]["results"]] == ["cache_aware", "mine", "sticky"]
    p = subprocess.run([sys.executable, "-m", "warmroute", "simulate", "--requests", "10", "--strategies", "mine"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown strategy 'mine'" in p.stderr and "--config" in p.stderr
    config.write_text("strategies: {mine: {stages: [prefix_match]}}\n")
    p = subprocess.run([sys.executable, "-m", "warmroute", "simulate", "--requests", "10", "--config", str(config),
                        "--strategies", "mine"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "strategies.mine: the last stage must be a picker" in p.stderr


def _shared_burst(wait_s: float):
    """16 clients at once on one instance, on prompts that share long prefixes (the `shared` workload)."""
    s = small(instances=1, requests=48, rate=None, concurrency=16,
              routing=StrategySettings(admission={"shared_prefill_wait_s": wait_s}))
    return Simulation(s, make_workload("shared", seed=1), "cache_aware").run()


def test_a_request_whose_prefix_its_instance_is_still_computing_waits_for_it_and_finds_it_cached():
    """Sent at once, a request whose prefix another request at its instance is computing would compute it too (the
    engine reuses only computed blocks); held until that one's first token, it finds it cached."""
    held, off = _shared_burst(10.0), _shared_burst(0.0)
    waited = [x for x in held.records if x.sent > x.arrival]
    assert waited and all(x.cached_tokens > 0 for x in waited)
    assert not any(x.sent > x.arrival for x in off.records)
    assert sum(x.cached_tokens for x in held.records) > sum(x.cached_tokens for x in off.records)
    assert all(x.done is not None for x in held.records)


def test_a_request_is_held_for_another_prefill_no_longer_than_shared_prefill_wait_s():
    r = _shared_burst(0.05)
    waits = [x.sent - x.arrival for x in r.records if x.sent > x.arrival]
    assert waits and max(waits) <= 0.05 + 1e-9 and all(x.done is not None for x in r.records)
