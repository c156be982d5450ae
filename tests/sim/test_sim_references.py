"""The simulator's SGLang-like reference follows the policy it claims to model (warmroute/sim/references.py):
a match over 30% of the prompt goes to its holder, a smaller one to the worker with the smallest tree, and a
holder far above the mean in-flight count is skipped for the least loaded."""

from __future__ import annotations

from warmroute.core.fleet import Fleet
from warmroute.core.routing_key import key_for_json
from warmroute.core.strategies import AFFINITY, OVERLOAD_SPILL, StrategySettings
from warmroute.core.strategies import Strategy
from warmroute.sim.references import sglang_like

SYSTEM = "You are a careful assistant. " * 40  # ≈1,100 characters


def chat(system: str, question: str):
    return key_for_json("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]})


def setup(n: int = 3) -> tuple[Fleet, Strategy]:
    fleet = Fleet()
    for i in range(n):
        fleet.add(f"w{i}", 100_000)
    return fleet, sglang_like(StrategySettings())


def test_a_long_match_goes_to_its_holder_whatever_the_load():
    fleet, s = setup()
    first = s.choose(chat(SYSTEM, "q0"), fleet)
    fleet.instances[first.instance].inflight = 3  # busier than the others, but under the spill margin
    again = s.choose(chat(SYSTEM, "another question"), fleet)
    assert again.instance == first.instance and again.reason == AFFINITY


def test_a_short_match_goes_to_the_smallest_tree():
    fleet, s = setup()
    big = s.choose(chat(SYSTEM, "q0"), fleet).instance
    short_system = "Be brief. "
    d = s.choose(chat(short_system, "an unrelated and much longer question " * 30), fleet)
    assert d.instance != big  # a fresh worker's tree is empty, so smaller than big's


def test_a_holder_far_above_the_mean_is_skipped_for_the_least_loaded():
    fleet, s = setup()
    holder = s.choose(chat(SYSTEM, "q0"), fleet).instance
    fleet.instances[holder].inflight = 12  # mean 4: above 4 + max(4, 2 x 2) and above 1.5 x 4
    d = s.choose(chat(SYSTEM, "q1"), fleet)
    assert d.instance != holder and d.reason == OVERLOAD_SPILL
