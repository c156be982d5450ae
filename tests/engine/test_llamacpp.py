"""warmroute in front of three real llama.cpp engines on CPUs: cache_aware beats random where it counts.

Each engine's prompt cache holds 3 prompts; 6 equally popular ~3.6k-token prefixes. Random routing makes every
engine see all 6, so most requests recompute theirs (~1 s); cache_aware keeps each prefix on one engine.
Skipped only where llama-cpp-python is not installed (pip install -e '.[llama]').
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed: pip install -e '.[llama]'")

from warmroute.realengine.fleet import LlamaFleetPlan, compare  # noqa: E402
from warmroute.realengine.reuse import ReuseCounters, install  # noqa: E402
from warmroute.realengine.tiny_model import TinyModelSpec, write_tiny_model  # noqa: E402

# 60 requests per strategy, the first 4 s (each prefix's first, compulsory miss) not measured
PLAN = replace(LlamaFleetPlan(), engines=3, prefixes=6, cached_prompts=3, concurrency=2, requests=60,
               warmup_s=4.0, duration_s=120.0)


def test_tiny_model_is_deterministic_and_one_token_per_byte(tmp_path: Path) -> None:
    from llama_cpp import Llama

    a = write_tiny_model(tmp_path / "a.gguf")
    b = write_tiny_model(tmp_path / "b.gguf")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != write_tiny_model(tmp_path / "c.gguf", TinyModelSpec(seed=1)).read_bytes()
    llm = Llama(model_path=str(a), vocab_only=True, verbose=False)
    text = "Refunds take 5 days, see the policy."
    assert len(llm.tokenize(text.encode())) == len(text) + 2  # + BOS and SentencePiece's leading space


def test_reuse_counts_the_prompt_tokens_llama_did_not_recompute(tmp_path: Path, monkeypatch) -> None:
    from llama_cpp import Llama

    for name in ("eval", "generate"):  # undo install() after the test
        monkeypatch.setattr(Llama, name, getattr(Llama, name))
    counters = ReuseCounters()
    install(counters)
    llm = Llama(model_path=str(write_tiny_model(tmp_path / "m.gguf")), n_ctx=2048, n_threads=1,
                n_threads_batch=1, verbose=False)
    shared = "The refund policy. " * 20
    first = llm.create_completion(shared + "First question?", max_tokens=2)["usage"]["prompt_tokens"]
    assert (counters.queries, counters.hits) == (first, 0)
    second = llm.create_completion(shared + "Second question?", max_tokens=2)["usage"]["prompt_tokens"]
    assert counters.queries == first + second
    assert len(shared) <= counters.hits < second  # the shared prefix (and BOS), not the new question


@pytest.mark.slow
def test_cache_aware_median_ttft_is_at_most_a_third_of_random(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", PLAN.model)
    by_random, by_cache = asyncio.run(compare(PLAN, ["random", "cache_aware"], model, tmp_path))
    for result in (by_random, by_cache):
        assert not result.errors, result.errors
        assert len(result.ok) >= 30
    r, c = by_random.summary(), by_cache.summary()
    print(f"\nTTFT p50: random {r['ttft_ms']['p50']} ms, cache_aware {c['ttft_ms']['p50']} ms; "
          f"engines' token reuse: random {r['hit_rate']['fleet']}, cache_aware {c['hit_rate']['fleet']}")
    assert c["hit_rate"]["fleet"] > r["hit_rate"]["fleet"]
    assert c["ttft_ms"]["p50"] <= r["ttft_ms"]["p50"] / 3
