"""Slow start (core/stages/slow_start.py): a new instance's share ramps up over the window instead of taking
every cold prefill at once, hot prefixes are copied to it first, and a fleet that starts cold does not ramp."""

from __future__ import annotations

from warmroute.core.decision import SLOW_START
from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.routing_key import key_for_json
from warmroute.core.strategies import CacheAwareSettings, Strategy, StrategySettings, make_strategy


def chat(system: str, user: str):
    return key_for_json("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})


def settings(window: float) -> StrategySettings:
    return StrategySettings(cache_aware=CacheAwareSettings(slow_start_window=window))


def test_off_when_the_window_is_zero():
    names = [s.name for s in make_strategy("cache_aware", settings(0.0)).pipeline.filters]
    assert "slow_start" not in names
    assert "slow_start" in [s.name for s in make_strategy("cache_aware").pipeline.filters]


def run_cold_traffic(window: float, seconds: float = 40.0, per_second: int = 20, in_flight: int = 6
                     ) -> list[list[str]]:
    """Three warm instances, a fourth joining at t=0; cold prompts at a steady rate, each finishing after
    `in_flight` later arrivals. The instances chosen, per second."""
    f = Fleet(FleetSettings())
    s = make_strategy("cache_aware", settings(window))
    for n in range(4):
        f.add(f"i{n}", 10**7)
    inflight: list[tuple[str, int]] = []
    seq = 0

    def send(now: float) -> str:
        nonlocal seq
        f.now = now
        d = s.choose(chat(f"tenant {seq} " * 50, f"q{seq}"), f)
        f.dispatched(d.instance, d.uncached_tokens, list(d.blocks))
        inflight.append((d.instance, d.uncached_tokens))
        if len(inflight) > in_flight:
            name, uncached = inflight.pop(0)
            f.first_token(name, uncached)
            f.finished(name, uncached)
        seq += 1
        return d.instance

    f.instances["i3"].healthy = False  # the warm fleet serves for a while
    for k in range(400):
        send(-20.0 + k * 0.05)
    f.instances["i3"].healthy = True
    f.start_ramp("i3", 0.0)
    return [[send(sec + k / per_second) for k in range(per_second)] for sec in range(int(seconds))]


def test_a_new_instance_ramps_up_instead_of_taking_every_cold_prompt():
    ramped = run_cold_traffic(window=30.0)
    at_once = run_cold_traffic(window=0.0)
    share = lambda per_second, a, b: sum(s.count("i3") for s in per_second[a:b]) / sum(map(len, per_second[a:b]))
    # Without slow start the cost model already spreads cold prompts by queue, so the new instance takes its
    # full quarter at once, on an empty cache; with it, a small share growing over the window.
    assert share(ramped, 0, 5) < 0.5 * share(at_once, 0, 5)
    assert share(ramped, 0, 5) < share(ramped, 10, 20) < share(ramped, 20, 30)
    assert share(ramped, 32, 40) > 0.2  # past the window: its full share again


def warm_fleet_with_a_hot_prompt(system: str) -> tuple[Fleet, Strategy]:
    """Four instances, the fourth joining at t=0.5 after the other three served a hot prompt 200 times."""
    f = Fleet(FleetSettings())
    s = make_strategy("cache_aware", settings(30.0))
    for n in range(4):
        f.add(f"i{n}", 10**7)
    f.instances["i3"].healthy = False
    for k in range(200):  # the hot prompt, held by the warm instances
        d = s.choose(chat(system, f"q{k}"), f)
        f.dispatched(d.instance, d.uncached_tokens, list(d.blocks))
        f.first_token(d.instance, d.uncached_tokens)
        f.finished(d.instance, d.uncached_tokens)
    assert "i3" not in f.index.match_depths(chat(system, "x").blocks(f.settings.block_bytes))
    f.instances["i3"].healthy = True
    f.start_ramp("i3", 0.0)
    f.now = 0.5
    return f, s


SUPPORT = "You are the support bot of a large shop. " * 80


def test_a_hot_prefix_is_copied_to_the_warming_instance_first():
    f, s = warm_fleet_with_a_hot_prompt(SUPPORT)
    d = s.choose(chat(SUPPORT, "new"), f)
    assert (d.instance, d.reason) == ("i3", SLOW_START)


def test_hot_prefixes_wait_for_the_warming_instance_to_have_no_queue():
    # Each hot request's whole prompt is a cold prefill on the new instance: sent there whatever its queue,
    # they would queue behind each other on it while the instances holding the prefix answer at once.
    f, s = warm_fleet_with_a_hot_prompt(SUPPORT)
    first = s.choose(chat(SUPPORT, "new " * 300), f)
    f.dispatched(first.instance, first.uncached_tokens, list(first.blocks))
    assert first.instance == "i3"
    while_queued = s.choose(chat(SUPPORT, "another"), f)
    assert while_queued.instance != "i3" and while_queued.reason != SLOW_START
    f.first_token("i3", first.uncached_tokens)  # its prefill is done (and the prefix is on it): its turn again
    assert s.choose(chat(SUPPORT, "a third"), f).instance == "i3"


def test_a_fleet_that_starts_cold_does_not_ramp():
    f = Fleet(FleetSettings())
    s = make_strategy("cache_aware", settings(30.0))
    for n in range(3):
        f.add(f"i{n}", 10**7)
        f.start_ramp(f"i{n}", 0.0)
    chosen = set()
    for k in range(30):
        d = s.choose(chat(f"doc {k} " * 40, "q"), f)
        f.dispatched(d.instance, d.uncached_tokens, list(d.blocks))
        chosen.add(d.instance)
    assert chosen == {"i0", "i1", "i2"}
    f.now = 31.0
    s.choose(chat("x" * 100, "q"), f)
    assert f.ramps == {}  # over: forgotten
