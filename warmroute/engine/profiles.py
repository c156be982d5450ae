"""How long one scheduler step of the emulated engine takes, and two calibrations of it.

The step-time model (milliseconds), for a step that prefills chunks i (e_i uncached tokens each, attending
to c_i context tokens = tokens already in the sequence's KV cache + e_i) and decodes for d sequences:

    step_ms = fixed + Σ_i (a·e_i + β·c_i + γ·e_i·c_i) + s·extra
    fixed   = prefill_base_ms if the step prefills anything, else itl_ms
    extra   = d - 1 in a pure-decode step (itl_ms is the batch-1 step), d in a step that also prefills
    s       = itl_ms · decode_growth                      (each extra decoding sequence slows the step)

Prefill is compute-bound: its cost grows with the uncached tokens, and, through β and γ, with the
context they attend to (so a cached prefix is cheap but not free). Decode is memory-bound: a batch-1 step
reads the weights (itl_ms), and each further sequence adds its own KV reads and compute.

Sources:
  * 8b: llm-d inference simulator profile for an 8B model on one H100: TTFT 30 ms + 0.25 ms per prompt
    token, inter-token latency 12 ms at batch 1.
  * 70b: Preble (Srivatsa et al., ICLR 2025) fit of prefill time for Llama-3-70B on H100:
    t_ms ≈ 28.9 + 0.182·e + 0.004·c + 2.55e-6·e·c; inter-token latency 25 ms at batch 1 from llm-d's
    simulator profile for 70B on 8×H100 (whose own prefill line, 80 ms + 0.5 ms/token, has no context
    term, so the Preble fit is used for prefill).
  * decode_growth = 1/64 (batch-1 ITL doubles at 64 decoding sequences) is our assumption, in line with
    published vLLM decode benchmarks on H100, not a cited fit.
  * KV per token, fp16: Llama-3-8B 128 KiB, Llama-3-70B 320 KiB (layers × KV heads × head dim × K,V × 2 B);
    capacity = (HBM × gpu_memory_utilization 0.9 − weights) / KV per token, ≈1.5 M tokens on 8×H100.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Timing:
    prefill_base_ms: float  # fixed cost of a step that prefills
    prefill_ms_per_token: float  # a: per uncached token
    itl_ms: float  # a pure-decode step at batch 1
    context_ms_per_token: float = 0.0  # β: per context token of a prefill chunk
    prefill_context_ms: float = 0.0  # γ: per (uncached token × context token)
    decode_growth: float = 1 / 64  # fraction of itl_ms each further decoding sequence adds

    def prefill_ms(self, uncached: int, context: int) -> float:
        """Variable cost of one prefill chunk (the step's fixed cost is charged once, in step_ms)."""
        return (self.prefill_ms_per_token * uncached + self.context_ms_per_token * context
                + self.prefill_context_ms * uncached * context)

    def step_ms(self, prefill_ms: float, prefilling: bool, decoding: int) -> float:
        """A step's duration, from the summed prefill_ms of its chunks and its decode batch size."""
        per_seq = self.itl_ms * self.decode_growth
        if prefilling:
            return self.prefill_base_ms + prefill_ms + per_seq * decoding
        return self.itl_ms + per_seq * (decoding - 1) if decoding else 0.0

    def with_overrides(self, prefill_tokens_per_s: float | None = None, itl_ms: float | None = None) -> Timing:
        """This timing with the per-token prefill rate and/or the batch-1 ITL replaced."""
        t = self
        if prefill_tokens_per_s is not None:
            t = replace(t, prefill_ms_per_token=1000.0 / prefill_tokens_per_s)
        if itl_ms is not None:
            t = replace(t, itl_ms=itl_ms)
        return t


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    timing: Timing
    kv_capacity_tokens: int
    kv_kib_per_token: float  # KV cache per token: what a disaggregated transfer moves


def kv_capacity_tokens(hbm_gib: float, weights_gib: float, kv_kib_per_token: float,
                       memory_utilization: float = 0.9) -> int:
    """Tokens of KV cache left once the weights are loaded (vLLM's gpu_memory_utilization default, 0.9)."""
    return int((hbm_gib * memory_utilization - weights_gib) * 1024 * 1024 / kv_kib_per_token)


PROFILES: dict[str, Profile] = {
    "8b": Profile(
        name="8b",
        description="8B model on one H100 80GB (llm-d simulator calibration)",
        timing=Timing(prefill_base_ms=30.0, prefill_ms_per_token=0.25, itl_ms=12.0),
        kv_capacity_tokens=kv_capacity_tokens(hbm_gib=80, weights_gib=15.0, kv_kib_per_token=128),
        kv_kib_per_token=128,
    ),
    "70b": Profile(
        name="70b",
        description="Llama-3-70B on 8×H100 80GB (Preble prefill fit, llm-d ITL)",
        timing=Timing(prefill_base_ms=28.9, prefill_ms_per_token=0.182, context_ms_per_token=0.004,
                      prefill_context_ms=2.55e-6, itl_ms=25.0),
        kv_capacity_tokens=kv_capacity_tokens(hbm_gib=8 * 80, weights_gib=131.5, kv_kib_per_token=320),
        kv_kib_per_token=320,
    ),
}
