"""Disaggregated prefill/decode in the simulator (sim/simulator.py with core/disaggregation.py): the two legs at
their pools, the KV moved before decoding, the books closed, and the router's decision as `serve` makes it."""

from __future__ import annotations

import subprocess
import sys

from warmroute.core.disaggregation import DisaggregationSettings
from warmroute.sim.report import summarize
from warmroute.sim.simulator import SimSettings, Simulation
from warmroute.workloads.registry import make_workload

LONG = {"system_tokens": 3000, "pool_size": 60, "max_tokens": 60}


def run(prefill: int = 2, threshold: int = 0, requests: int = 400, rate: float = 3.0, transfer: float = 100_000.0,
        workload: str = "shared", **params):
    settings = SimSettings(instances=4, requests=requests, rate=rate, seed=3, prefill_instances=prefill,
                           pd=DisaggregationSettings(pd_threshold_tokens=threshold), transfer_tokens_per_s=transfer)
    sim = Simulation(settings, make_workload(workload, seed=3, **(params or LONG)), "cache_aware")
    return sim, sim.run()


def test_split_requests_prefill_in_the_prefill_pool_and_decode_in_the_decode_pool():
    sim, r = run()
    roles = {name: inst.role for name, inst in sim.fleet.instances.items()}
    assert sorted(roles.values()) == ["decode", "decode", "prefill", "prefill"]
    split = [x for x in r.records if x.prefill_instance]
    assert split and len(r.records) == 400
    assert all(x.done is not None and x.first_token is not None and x.output_tokens == 60 for x in r.records)
    assert all(roles[x.prefill_instance] == "prefill" and roles[x.instance] == "decode" for x in split)
    assert all(roles[x.instance] == "decode" for x in r.records)  # whole ones too: prefill instances do not decode
    assert all(i.inflight == i.pending == 0 and i.inflight_prompt_tokens == 0 for i in sim.fleet.instances.values())
    assert all(not i.model._held for i in sim.instances.values())  # every prefill's kept blocks were read and let go


def test_the_prefill_pool_keeps_its_prefixes_warm():
    _, r = run(threshold=0)
    split = [x for x in r.records if x.prefill_instance]
    asked = sum(x.prompt_tokens for x in split)
    assert sum(x.prefill_cached_tokens for x in split) / asked > 0.7  # 60 prompts of 3,000 tokens, 400 requests


def test_a_slower_transfer_delays_the_first_token_of_split_requests():
    unique = {**LONG, "pool_size": 5000}  # prompts their decode instance never saw: all of each moves
    fast = summarize(run(threshold=0, transfer=1e9, **unique)[1])
    slow = summarize(run(threshold=0, transfer=5_000, **unique)[1])
    assert slow.ttft_p50_ms > fast.ttft_p50_ms + 300  # 3,000 tokens at 5,000 tokens/s: 0.6 s more


def test_short_prompts_stay_whole_below_the_threshold():
    _, r = run(threshold=512, workload="chat", max_tokens=30, system_tokens=100, user_tokens=40)
    assert summarize(r).split == 0.0 and {x.instance for x in r.records} <= {"instance-2", "instance-3"}


def test_without_prefill_instances_nothing_is_split_and_every_instance_decodes():
    _, r = run(prefill=0)
    assert not any(x.prefill_instance for x in r.records) and len({x.instance for x in r.records}) == 4


def test_the_command_line_runs_a_split_fleet_and_refuses_one_without_a_decode_instance():
    base = [sys.executable, "-m", "warmroute", "simulate", "--workload", "shared", "--requests", "100", "--rate",
            "2", "--instances", "4", "--strategies", "cache_aware"]
    ok = subprocess.run(base + ["--prefill-instances", "2", "--pd-threshold-tokens", "0"], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "cache_aware" in ok.stdout
    bad = subprocess.run(base + ["--prefill-instances", "4"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "--prefill-instances" in bad.stderr
