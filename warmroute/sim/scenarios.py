"""Named scenarios for `warmroute simulate --scenario`.

reference-70b: the managed router's published benchmark, modelled. Seven ml.p5.48xlarge instances (8×H100
80 GB) serve Llama-3.1-70B with prefix caching on; long-context prompts whose shared prefix is over 8k
tokens; 16 configurations = 4 prefix lengths × 2 concurrency levels × 2 prefix-pool sizes.
  * Engine: the `70b` profile (Preble's prefill fit for Llama-3-70B on H100, llm-d's 25 ms ITL) and its KV
    capacity, (8 × 80 GiB × 0.9 − 131.5 GiB of fp16 weights) / 320 KiB per token ≈ 1.45 M tokens.
  * Pool sizes: the pool's prefixes fill 2× or 4× one instance's cache (they always fit in the fleet's 7×),
    so random routing, which makes every instance cache every prefix, keeps only part of the pool, while a
    prefix-aware router gives each instance about a seventh of it.
  * Each request: one prefix drawn uniformly from the pool, a unique 256-token question, 128 output tokens,
    closed loop at 16 or 64 concurrent clients.
The reference's exact prompt pool and load are not published; these are our stated assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from warmroute.core.strategies import StrategySettings
from warmroute.engine.profiles import PROFILES
from warmroute.sim.simulator import SimSettings
from warmroute.workloads.shared import SharedPrompts

PREFIX_TOKENS = (8192, 12288, 16384, 24576)
CONCURRENCY = (16, 64)
POOL_FILL = (2, 4)  # the pool's prefix tokens, in multiples of one instance's KV capacity


@dataclass
class ScenarioCase:
    label: str
    settings: SimSettings
    workload: SharedPrompts


def reference_70b(requests: int = 1500, seed: int = 0) -> list[ScenarioCase]:
    capacity = PROFILES["70b"].kv_capacity_tokens
    base = SimSettings(instances=7, profile="70b", max_running=256, requests=requests, seed=seed,
                       routing=StrategySettings(prefix_length=4096, concurrency_threshold=64))
    cases = []
    for tokens in PREFIX_TOKENS:
        for fill in POOL_FILL:
            pool = max(8, fill * capacity // tokens)
            for conc in CONCURRENCY:
                workload = SharedPrompts(seed=seed, pool_size=pool, system_tokens=tokens, question_tokens=256,
                                         zipf=0.0, max_tokens=128)
                cases.append(ScenarioCase(f"prefix {tokens // 1024}k, pool {pool}, concurrency {conc}",
                                          replace(base, concurrency=conc), workload))
    return cases


SCENARIOS = {"reference-70b": reference_70b}
