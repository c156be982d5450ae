"""Autoscaling end to end, over real HTTP on loopback: emulated engines whose pods the router finds through a test
Kubernetes API (warmroute/bench/kube_api.py). The deletion-cost annotations follow what each instance's cache is worth
and a ReplicaSet-style scale-in removes the lowest, `GET /admin/scale-in` names it, a pod that joins ramps up (slow
start) with a hot prefix copied to it first, and /metrics carries the demand signal."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from client_helpers import ask, wait_for
from warmroute.bench.kube_api import Stack
from warmroute.core.demand import desired_for
from warmroute.engine.server import DEFAULT_MODEL
from warmroute.router.app import ROUTER
from warmroute.router.kubernetes import DELETION_COST, REWRITE_CHANGE, costs_to_write

AUTH = {"Authorization": f"Bearer {Stack.TOKEN}"}


def chat(doc: str, question: int, size: int = 60) -> dict:
    system = f"Document {doc}. " + "".join(f"Clause {doc}.{i}: term {i * 7}. " for i in range(size))
    return {"model": DEFAULT_MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Question {question}"}]}


async def scrape(client: aiohttp.ClientSession, url: str) -> dict[str, dict[str, float]]:
    """One /metrics scrape: series name -> model label (or "") -> value."""
    async with client.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = ":".join(filter(None, (s.labels.get("model", ""), s.labels.get("dimension", ""))))
            out.setdefault(s.name, {})[key] = s.value
    return out


def ordered_alike(got: dict[str, float], expected: dict[str, float]) -> bool:
    """Every pair that `expected` tells apart (by more than rounding), `got` orders the same way."""
    return all(got[a] < got[b] for a in expected for b in expected if expected[a] < expected[b] - 1e-9)


def test_a_cost_is_written_again_when_the_order_changes_or_it_moved_enough():
    assert costs_to_write({}, {"a": 10, "b": 20}) == {"a": 10, "b": 20}  # new pods
    assert costs_to_write({"a": 100, "b": 200}, {"a": 103, "b": 190}) == {}  # within 5%, same order
    assert costs_to_write({"a": 100, "b": 200}, {"a": 120, "b": 200}) == {"a": 120}  # moved by 20%
    assert costs_to_write({"a": 100, "b": 104}, {"a": 105, "b": 103}) == {"a": 105, "b": 103}  # order swapped
    assert costs_to_write({"a": 0, "b": 0}, {"a": 0, "b": 0}) == {}  # unchanged


async def test_deletion_costs_follow_cache_value_and_a_scale_in_removes_the_lowest(tmp_path, monkeypatch):
    stack = await Stack().start(tmp_path, monkeypatch, 3)
    try:
        # Six documents, doc k asked k + 1 times, interleaved so none carries a third of the recent requests (a hot
        # prefix would be copied to more instances, and no longer be any one's alone).
        asks = [k for round_ in range(6) for k in range(6) if round_ <= k]
        placed: dict[int, set[str]] = {}
        async with aiohttp.ClientSession() as client:
            for q, doc in enumerate(asks):
                a = await ask(client, stack.url, chat(str(doc), q))
                placed.setdefault(doc, set()).add(a.instance)
            assert all(len(v) == 1 for v in placed.values())  # each document stayed where it was first placed
            # What each instance holds alone, weighted by how often it is asked: the share of requests x tokens.
            expected = dict.fromkeys(stack.fleet.instances, 0.0)
            for doc, (name,) in placed.items():
                expected[name] += (doc + 1) / len(asks)
            async with client.get(stack.url + "/admin/scale-in") as r:
                assert r.status == 401
            async with client.get(stack.url + "/admin/scale-in", headers=AUTH) as r:
                assert r.status == 200
                answer = await r.json()
        values, costs = answer["values"], answer["deletion_costs"]
        assert ordered_alike(values, expected) and ordered_alike(costs, expected)
        assert expected[answer["victim"]] == min(expected.values())
        # The pods' annotations follow (checked every 0.5 s; written again when the order changes or a cost moves
        # by more than 5%).
        def caught_up() -> bool:
            annotations = {p: stack.annotation(p) for p in costs}
            return None not in annotations.values() and ordered_alike(annotations, expected) and all(
                abs(annotations[p] - costs[p]) <= REWRITE_CHANGE * max(annotations[p], 1) for p in costs)

        await wait_for(caught_up, timeout=10)
        annotations = {p: stack.annotation(p) for p in costs}
        for pod in costs:  # written only when it changed, never the same value twice in a row
            written = [patch["metadata"]["annotations"][DELETION_COST] for p, patch in stack.api.patches if p == pod]
            assert all(a != b for a, b in zip(written, written[1:])), written
        # A ReplicaSet scaling in deletes the pod with the lowest deletion cost: it terminates, the router drains it.
        lowest = answer["victim"]
        assert stack.annotation(lowest) == min(annotations.values())
        stack.set_pod(int(lowest.rsplit("-", 1)[1]), terminating=True)
        await wait_for(lambda: lowest not in stack.fleet.instances, timeout=10)
    finally:
        await stack.stop()


async def test_a_joining_pod_ramps_up_with_the_hot_prefix_first(tmp_path, monkeypatch):
    """A window far longer than the test keeps the new pod near its first-second weight (10%) throughout, so
    what it receives does not depend on how fast this machine sends."""
    stack = await Stack().start(tmp_path, monkeypatch, 4, ready=3, slow_start_window=600)
    try:
        async with aiohttp.ClientSession() as client:
            for q in range(30):  # a hot system prompt on half the requests, cold documents on the rest
                await ask(client, stack.url, chat("hot", q))
                await ask(client, stack.url, chat(f"cold-{q}", q))
            stack.set_pod(3)
            await wait_for(lambda: "vllm-3" in stack.fleet.instances and stack.fleet.instances["vllm-3"].healthy,
                           timeout=10)
            assert "vllm-3" in stack.fleet.ramps
            first = await ask(client, stack.url, chat("hot", 99))
            assert (first.instance, first.reason) == ("vllm-3", "slow_start")  # the hot prefix is copied there
            later = [(await ask(client, stack.url, chat(f"new-{q}", q))).instance for q in range(40)]
            decisions = (await scrape(client, stack.url))["warmroute_decisions_total"]
        # Its full share would be a quarter of the cold requests; ramping, it takes a few, not none.
        assert 1 <= later.count("vllm-3") <= 8, later
        assert decisions  # the decisions counter is exported
    finally:
        await stack.stop()


async def test_the_demand_signal_is_on_metrics(tmp_path, monkeypatch):
    stack = await Stack().start(tmp_path, monkeypatch, 2, scale_target=0.001, max_instances=50)
    settings = stack.router.app[ROUTER].settings
    try:
        async with aiohttp.ClientSession() as client:
            await wait_for(lambda: all(i.models for i in stack.fleet.instances.values()), timeout=10)
            idle = await scrape(client, stack.url)
            assert idle["warmroute_fleet_demand_ratio"] == {DEFAULT_MODEL: 0.0}
            assert idle["warmroute_desired_instances"] == {DEFAULT_MODEL: 1.0}  # min_instances
            for q in range(20):
                await ask(client, stack.url, chat(f"doc-{q}", q, size=200))
            busy = await scrape(client, stack.url)
        ratio = busy["warmroute_fleet_demand_ratio"][DEFAULT_MODEL]
        desired = busy["warmroute_desired_instances"][DEFAULT_MODEL]
        assert ratio > 0.0
        assert desired == desired_for(2, ratio, settings) and desired > 2  # a 0.1% target: more instances wanted
        # The dimensions an autoscaler of several replicas sums before taking the highest: the ratio is theirs.
        dims = busy["warmroute_fleet_utilization"]
        assert set(dims) == {f"{DEFAULT_MODEL}:{d}" for d in ("prefill", "decode", "kv")}
        assert max(dims.values()) == pytest.approx(ratio)
    finally:
        await stack.stop()


def test_the_demand_is_per_model_over_the_instances_serving_it():
    from warmroute.core.admission import Admission, AdmissionSettings
    from warmroute.core.demand import DemandSettings
    from warmroute.core.fleet import Fleet
    from warmroute.router.autoscaling import ALL_MODELS, FleetSignals

    fleet = Fleet()
    for name in ("a1", "a2", "b1"):
        fleet.add(name, 100_000, 1_000.0)
    signals = FleetSignals(fleet, Admission(AdmissionSettings(), fleet), DemandSettings(scale_target=0.5), 8)
    assert set(signals.by_model()) == {ALL_MODELS}  # nobody says what it serves: the whole fleet
    fleet.set_models("a1", frozenset({"m-a"}))
    fleet.set_models("a2", frozenset({"m-a"}))
    fleet.set_models("b1", frozenset({"m-b"}))
    for _ in range(6):  # m-b's one instance: 6 requests in flight of the 8 it may take
        fleet.dispatched("b1", 0)
        signals.dispatched(fleet.instances["b1"], 0)
    demand = signals.by_model()
    assert set(demand) == {"m-a", "m-b"}
    assert demand["m-a"].ratio == 0.0 and demand["m-a"].current == 2 and demand["m-a"].desired == 1
    assert demand["m-b"].ratio == 6 / 8 and demand["m-b"].bottleneck == "decode"
    assert demand["m-b"].current == 1 and demand["m-b"].desired == 2  # ceil(1 x 0.75 / 0.5)
    assert demand["m-b"].demand.dimensions() == {"prefill": 0.0, "decode": 6 / 8, "kv": 0.0}
