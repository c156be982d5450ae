"""The emulated engine's pure model: prefix hits, eviction, admission, timing, fused decode, cancel."""

from __future__ import annotations

import pytest

from warmroute.engine.model import EngineConfig, EngineModel, StepResult
from warmroute.engine.profiles import PROFILES, Timing

# Round numbers: a step that prefills costs 10 ms + 1 ms per uncached token; a pure-decode step 5 ms at
# batch 1, +0.5 ms per further sequence. Blocks of 4 tokens; chains are plain ints (any distinct hashes).
TIMING = Timing(prefill_base_ms=10.0, prefill_ms_per_token=1.0, itl_ms=5.0, decode_growth=0.1)


def engine(capacity_blocks: int = 64, **settings: int) -> EngineModel:
    settings.setdefault("max_batched_tokens", 256)
    return EngineModel(EngineConfig(TIMING, kv_capacity_tokens=capacity_blocks * 4, block_size=4, **settings))


def run(model: EngineModel) -> list[StepResult]:
    results = []
    while not model.idle:
        results.append(model.step())
    return results


def first_token(model: EngineModel, seq_id: str) -> int:
    """Step until `seq_id` gets its first token; return its cached prompt tokens."""
    while True:
        result = model.step()
        if seq_id in result.first_tokens:
            return result.first_tokens[seq_id]


def test_repeated_prompt_hits_the_cache_in_whole_blocks() -> None:
    m = engine()
    m.submit("a", [1, 2, 3, 4], prompt_tokens=18, max_tokens=2)
    assert first_token(m, "a") == 0
    run(m)
    m.submit("b", [1, 2, 3, 4], prompt_tokens=18, max_tokens=2)
    assert first_token(m, "b") == 16
    m.submit("c", [1, 2, 7], prompt_tokens=13, max_tokens=2)  # shares two blocks, then diverges
    assert first_token(m, "c") == 8
    assert (m.stats.prefix_queries, m.stats.prefix_hits) == (18 + 18 + 13, 16 + 8)


def test_last_prompt_token_is_always_recomputed() -> None:
    m = engine()
    m.submit("a", [1, 2], prompt_tokens=8, max_tokens=1)
    run(m)
    m.submit("b", [1, 2], prompt_tokens=8, max_tokens=1)  # all blocks cached, but vLLM needs logits
    assert first_token(m, "b") == 4


def test_prefill_is_charged_only_for_uncached_tokens() -> None:
    m = engine()
    m.submit("a", [1, 2, 3, 4], prompt_tokens=18, max_tokens=1)
    assert m.step().duration == pytest.approx((10 + 18) / 1000)
    m.submit("b", [1, 2, 3, 4], prompt_tokens=18, max_tokens=1)
    assert m.step().duration == pytest.approx((10 + 2) / 1000)


def test_profiles_match_their_calibrations() -> None:
    m8 = EngineModel(EngineConfig.from_profile("8b"))
    m8.submit("a", [], prompt_tokens=1000, max_tokens=1)
    assert m8.step().duration == pytest.approx((30 + 0.25 * 1000) / 1000)  # llm-d 8B/H100
    m70 = EngineModel(EngineConfig.from_profile("70b"))
    blocks = list(range(500))  # 8000 tokens in 16-token blocks
    m70.submit("a", blocks, prompt_tokens=8001, max_tokens=1)
    m70.step()
    m70.submit("b", blocks, prompt_tokens=8001, max_tokens=1)
    e, c = 1, 8001  # one uncached token over an 8001-token context
    preble_ms = 28.9 + 0.182 * e + 0.004 * c + 2.55e-6 * e * c
    assert m70.step().duration == pytest.approx(preble_ms / 1000)
    assert PROFILES["70b"].kv_capacity_tokens == pytest.approx(1.5e6, rel=0.05)


def test_overrides_replace_prefill_rate_and_itl() -> None:
    cfg = EngineConfig.from_profile("8b", prefill_tokens_per_s=10_000, itl_ms=20)
    assert cfg.timing.prefill_ms_per_token == pytest.approx(0.1)
    m = EngineModel(cfg)
    m.submit("a", [], prompt_tokens=15, max_tokens=3)
    m.step()
    assert m.step().duration == pytest.approx(0.020)


def test_evicts_from_the_front_of_the_free_queue_as_vllm_does() -> None:
    m = engine(capacity_blocks=8)
    for seq_id, chain in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
        m.submit(seq_id, chain, prompt_tokens=9, max_tokens=1)  # 3 blocks: 2 full prompt blocks + the rest
        run(m)
    m.submit("a2", [1, 2], prompt_tokens=9, max_tokens=1)  # a's chain taken again: freed last, most recent
    run(m)
    assert m.pool.lru_order() == [4, 3, 6, 5, 2, 1]  # tail first: a chain is evicted from its end
    # d takes the queue's front, whatever it holds (vLLM does not prefer the empty blocks behind it):
    # b's two cached blocks and an empty one
    m.submit("d", [7, 8], prompt_tokens=9, max_tokens=1)
    run(m)
    assert 4 not in m.pool and 3 not in m.pool and all(b in m.pool for b in (1, 2, 5, 6, 7, 8))
    m.submit("e", [], prompt_tokens=3, max_tokens=1)  # one block: c's tail
    run(m)
    assert 6 not in m.pool and 5 in m.pool
    m.submit("c2", [5, 6], prompt_tokens=9, max_tokens=1)
    assert first_token(m, "c2") == 4  # c's head block survived its tail


def test_blocks_in_use_are_never_evicted() -> None:
    m = engine(capacity_blocks=8)
    m.submit("x", [9], prompt_tokens=5, max_tokens=1)  # leaves block 9 cached and unpinned
    run(m)
    m.submit("a", [1, 2], prompt_tokens=9, max_tokens=12)  # 2 prompt blocks + 4 reserved while running
    first_token(m, "a")
    m.submit("b", [3], prompt_tokens=5, max_tokens=3)  # needs 2 blocks, 1 free: evicts x's block
    first_token(m, "b")
    assert 9 not in m.pool and 1 in m.pool and 2 in m.pool
    m.submit("c", [5], prompt_tokens=5, max_tokens=3)  # no unpinned block left to evict: c waits
    m.step()
    assert (m.num_running, m.num_waiting) == (2, 1)
    assert 1 in m.pool and 2 in m.pool and m.kv_usage == 1.0


def test_identical_prompts_admitted_together_do_not_hit_each_other() -> None:
    m = engine()
    m.submit("a", [1, 2, 3], prompt_tokens=13, max_tokens=1)
    m.submit("b", [1, 2, 3], prompt_tokens=13, max_tokens=1)  # a's blocks are not computed yet
    result = m.step()
    assert result.first_tokens == {"a": 0, "b": 0}


def test_chunked_prefill_shares_the_token_budget_with_decode() -> None:
    m = engine(max_batched_tokens=8, max_running=4)
    m.submit("short", [], prompt_tokens=3, max_tokens=10)
    first_token(m, "short")
    m.submit("long", [1, 2, 3, 4], prompt_tokens=20, max_tokens=1)
    steps = [m.step() for _ in range(3)]
    # 8 tokens per step: 1 decode token for "short" + 7 prefill tokens: 20 tokens take 3 steps
    assert [r.tokens.get("short") for r in steps] == [1, 1, 1]
    assert [("long" in r.first_tokens) for r in steps] == [False, False, True]
    assert steps[0].duration == pytest.approx((10 + 7 + 0.5 * 1) / 1000)


def test_admission_limit_makes_the_rest_wait_in_order() -> None:
    m = engine(max_running=2)
    for i in range(3):
        m.submit(f"s{i}", [], prompt_tokens=2, max_tokens=2 + i)
    assert set(m.step().first_tokens) == {"s0", "s1"}
    assert (m.num_running, m.num_waiting) == (2, 1)
    result = m.step()
    assert result.finished == ["s0"] and "s2" not in result.first_tokens
    result = m.step()
    assert "s2" in result.first_tokens and result.finished == ["s1"]  # s2 admitted once s0 left
    assert m.stats.requests_finished == 2


def test_decode_slows_as_the_batch_grows() -> None:
    durations = {}
    for batch in (1, 4, 16):
        m = engine()
        for i in range(batch):
            m.submit(i, [], prompt_tokens=2, max_tokens=5)
        m.step()  # prefill all
        durations[batch] = m.step().duration
        assert durations[batch] == pytest.approx(m.decode_step_seconds)
    assert durations[1] == pytest.approx(0.005)
    assert durations[1] < durations[4] < durations[16]
    assert durations[16] == pytest.approx((5 + 0.5 * 15) / 1000)


def submit_batch(m: EngineModel) -> None:
    for i, max_tokens in enumerate((3, 40, 17, 17, 90)):
        m.submit(i, [i, 100 + i], prompt_tokens=10 + i, max_tokens=max_tokens)


def finish_times(m: EngineModel, max_decode_steps: int) -> tuple[dict[int, float], int]:
    clock, finished, calls = 0.0, {}, 0
    while not m.idle:
        result = m.step(max_decode_steps)
        clock += result.duration
        calls += 1
        finished.update({s: clock for s in result.finished})
    return finished, calls


def test_fused_decode_steps_equal_the_sum_of_single_steps() -> None:
    single, fused = engine(), engine()
    submit_batch(single)
    submit_batch(fused)
    t_single, calls_single = finish_times(single, 1)
    t_fused, calls_fused = finish_times(fused, 1000)
    assert t_fused.keys() == t_single.keys() == set(range(5))
    for s in t_single:
        assert t_fused[s] == pytest.approx(t_single[s])
    assert single.stats == fused.stats
    assert calls_fused < calls_single / 5


def test_fusing_stops_at_the_next_finish_and_at_an_admissible_arrival() -> None:
    m = engine()
    m.submit("a", [], prompt_tokens=2, max_tokens=10)
    m.submit("b", [], prompt_tokens=2, max_tokens=4)
    assert m.fusible_decode_steps() == 0  # prefill first
    m.step()
    assert m.fusible_decode_steps() == 3  # b has 3 tokens to go
    result = m.step(100)
    assert (result.steps, result.finished, result.tokens) == (3, ["b"], {"a": 3, "b": 3})
    m.submit("c", [], prompt_tokens=2, max_tokens=1)
    assert m.fusible_decode_steps() == 0  # c can be admitted: the next step must prefill it


def test_cancel_frees_blocks_and_keeps_computed_ones_cached() -> None:
    m = engine(max_running=1)
    m.submit("a", [1, 2], prompt_tokens=9, max_tokens=50)
    m.submit("b", [5], prompt_tokens=5, max_tokens=1)
    m.step()
    assert m.kv_usage > 0 and m.num_waiting == 1
    assert m.cancel("b") and m.num_waiting == 0
    assert m.cancel("a") and m.idle
    assert m.kv_usage == 0 and m.pool.num_free_blocks == m.pool.num_blocks
    assert m.pool.lru_order() == [2, 1]  # computed, now evictable
    assert not m.cancel("a")
    assert m.stats.requests_cancelled == 2
    assert m.step() == StepResult()


def test_submit_rejects_what_can_never_fit() -> None:
    m = engine(capacity_blocks=8)
    with pytest.raises(ValueError, match="KV cache"):
        m.submit("big", [], prompt_tokens=30, max_tokens=3)
    m.submit("a", [], prompt_tokens=2, max_tokens=1)
    with pytest.raises(ValueError, match="already"):
        m.submit("a", [], prompt_tokens=2, max_tokens=1)


def test_a_remote_sequence_loads_past_its_local_hit_then_computes_one_token() -> None:
    m = engine()
    m.submit("warm", [1, 2], prompt_tokens=9, max_tokens=1)
    run(m)
    m.submit("d", [1, 2, 3, 4], prompt_tokens=18, max_tokens=2, remote=True)
    result = m.step()
    assert result.loads == {"d": 10} and result.duration == 0  # blocks 1, 2 are local; nothing computed yet
    assert m.num_waiting == 1 and m.num_running == 0 and m.stalled and not m.idle
    assert m.loaded("d") and not m.loaded("d")
    assert m.pool.match([1, 2, 3, 4]) == 4  # the loaded full blocks are cached at once
    result = m.step()
    assert result.first_tokens == {"d": 18}  # vLLM's cached count: local and loaded tokens
    assert result.duration == pytest.approx((10 + 1) / 1000)  # the last prompt token, computed again
    run(m)
    stats = m.stats
    assert (stats.external_queries, stats.external_hits, stats.computed_tokens) == (9 + 10, 10, 9)


def test_a_remote_sequence_whose_kv_never_came() -> None:
    m = engine()
    m.submit("a", [1, 2], prompt_tokens=9, max_tokens=1, remote=True)
    m.submit("b", [5, 6], prompt_tokens=9, max_tokens=1, remote=True)
    assert m.step().loads == {"a": 9, "b": 9}
    assert m.load_failed("a", recompute=True)  # computed here instead
    assert m.step().first_tokens == {"a": 0}
    assert m.load_failed("b", recompute=False) and m.stats.requests_failed == 1
    run(m)
    assert m.idle and m.kv_usage == 0 and 5 not in m.pool


def test_a_hold_sequence_keeps_its_prompt_blocks_until_released() -> None:
    m = engine(capacity_blocks=8)
    m.submit("p", [1, 2], prompt_tokens=9, max_tokens=4, hold=True)  # 4 blocks: 3 for the prompt, 1 for output
    run(m)
    assert len(m.held_block_ids("p")) == 3 and m.pool.num_free_blocks == 5
    m.submit("big", [], prompt_tokens=20, max_tokens=4)  # 6 blocks: waits for the held ones
    assert m.stalled and m.step().steps == 1 and m.num_waiting == 1
    assert m.release("p") and not m.release("p") and m.held_block_ids("p") == []
    assert not m.stalled
    run(m)
    assert m.kv_usage == 0


def test_a_sequence_without_the_cache_neither_hits_nor_feeds_it() -> None:
    m = engine()
    m.submit("a", [1, 2], prompt_tokens=9, max_tokens=1)
    run(m)
    m.submit("b", [1, 2, 3], prompt_tokens=13, max_tokens=1, remote=True, cache=False)
    assert m.step().loads == {"b": 13}
    m.loaded("b")
    run(m)
    assert 3 not in m.pool and m.stats.prefix_queries == 9
