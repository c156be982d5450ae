"""Engine feedback in the core: verdicts from plain values, the learnt capacity scale, and what Fleet.feedback
does to the index (the measured effect is in docs/feedback.md)."""

import pytest

from warmroute.core import feedback as fb
from warmroute.core.fleet import Fleet, FleetSettings

BT = 16  # tokens per block at the default 64-byte block


# -- verdicts ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cached,engine_prompt,prompt,want", [
    (160, None, 400, 10),  # the router's tokens: 160 // 16
    (175, None, 400, 10),  # block rounding down
    (100, 200, 400, 12),  # the engine counts half the router's tokens: 100/200 of 400 = 200 tokens = 12 blocks
    (10_000, None, 400, 25),  # never more than the chain
    (0, 300, 400, 0),
])
def test_reported_blocks_converts_the_engines_tokens_to_router_blocks(cached, engine_prompt, prompt, want):
    assert fb.reported_blocks(cached, engine_prompt, prompt, BT, chain_blocks=25) == want


@pytest.mark.parametrize("predicted,reported,kind", [
    (10, 10, fb.CONFIRMED),
    (10, 9, fb.CONFIRMED),  # vLLM never counts the last prompt token: a whole-prompt hit reports a block less
    (10, 11, fb.CONFIRMED),  # the engine's blocks round differently
    (10, 8, fb.OVERPREDICTED),
    (10, 0, fb.OVERPREDICTED),
    (0, 2, fb.UNDERPREDICTED),
    (0, 1, fb.CONFIRMED),
])
def test_judge_compares_in_blocks_with_one_block_of_tolerance(predicted, reported, kind):
    v = fb.judge(predicted, reported)
    assert (v.kind, v.predicted_blocks, v.reported_blocks) == (kind, predicted, reported)


@pytest.mark.parametrize("predicted,engine_prompt,prompt,want", [
    (0, None, 400, 1 + 2),  # one router block, and the engine's 32-token rounding is two router blocks
    (100, None, 1600, 1 + 2 + 5),  # and 5% of a 100-block prediction
    (100, 2000, 1600, 1 + 2 + 5),  # the engine's 32 tokens are 25.6 router tokens: still two blocks
    (40, 800, 1600, 1 + 4 + 2),  # an engine counting half the router's tokens: its block is 4 router blocks
])
def test_tolerance_covers_the_engines_block_rounding_and_the_token_ratio(predicted, engine_prompt, prompt, want):
    assert fb.tolerance_blocks(predicted, engine_prompt, prompt, BT) == want


def test_a_report_within_an_engine_block_confirms_a_prediction_one_block_would_not():
    tolerance = fb.tolerance_blocks(40, 1000, 1000, BT)
    assert fb.judge(40, 37).kind == fb.OVERPREDICTED
    assert fb.judge(40, 37, tolerance).kind == fb.CONFIRMED
    assert fb.judge(40, 40 - tolerance - 1, tolerance).kind == fb.OVERPREDICTED


# -- the capacity scale ------------------------------------------------------------------------------------------
OVER = fb.Verdict(fb.OVERPREDICTED, 10, 0)
UNDER = fb.Verdict(fb.UNDERPREDICTED, 0, 10)
OK = fb.Verdict(fb.CONFIRMED, 5, 5)


def test_scale_is_unmoved_by_confirmed_predictions():
    s = fb.CapacityScale()
    assert not s.update(OK) and s.value == 1.0


def test_scale_steps_grow_while_errors_point_the_same_way_and_halve_when_they_turn():
    s = fb.CapacityScale()
    for _ in range(30):
        s.update(OVER)
    assert s.step == fb.STEP_MAX and s.value < 0.25  # a 4x error is undone within a few dozen reports
    low = s.value
    s.update(UNDER)
    assert s.step == fb.STEP_MAX * fb.STEP_DECAY and s.value == pytest.approx(low * (1 + s.step))


def test_scale_settles_when_errors_alternate():
    s = fb.CapacityScale()
    for _ in range(20):
        s.update(OVER)
        s.update(UNDER)
    assert s.step == fb.STEP_MIN and 0.9 < s.value < 1.0


def test_scale_is_bounded():
    s = fb.CapacityScale()
    for _ in range(1000):
        s.update(OVER)
    assert s.value == fb.SCALE_MIN


# -- Fleet.feedback ----------------------------------------------------------------------------------------------
def fleet(capacity_tokens: int = 1600, feedback: bool = True) -> Fleet:
    f = Fleet(FleetSettings(feedback=feedback))
    for name in ("a", "b"):
        f.add(name, capacity_tokens)
    return f


def chain(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_overprediction_shrinks_every_instance_model_but_keeps_the_chain_just_recomputed():
    f = fleet()
    f.index.record("a", chain(40))
    v = f.feedback("a", chain(40), predicted_tokens=40 * BT, cached_tokens=0)
    assert v.kind == fb.OVERPREDICTED
    assert f.cache_scale.value < 1
    assert f.index.capacity("a") == f.index.capacity("b") == int(1600 * f.cache_scale.value) // BT
    assert f.index.match_depths(chain(40))["a"] == 40  # the engine holds it now: it just computed it


def test_underprediction_records_the_reported_chain_and_grows_the_model_once_the_index_is_full():
    f = fleet()
    f.index.record("a", chain(10, start=1000))  # far from full (100 blocks)
    v = f.feedback("a", chain(30), predicted_tokens=0, cached_tokens=20 * BT)
    assert v.kind == fb.UNDERPREDICTED and f.index.match_depths(chain(30))["a"] == 20
    assert f.cache_scale.value == 1.0  # a half-empty index forgot nothing: not evidence it is too small
    f.index.record("a", chain(100, start=2000))  # now full: it has evicted
    f.feedback("a", chain(30, start=5000), predicted_tokens=0, cached_tokens=20 * BT)
    assert f.cache_scale.value > 1 and f.index.capacity("a") > 100


def test_confirmed_prediction_changes_nothing():
    f = fleet()
    f.index.record("a", chain(20))
    assert f.feedback("a", chain(20), 20 * BT, 19 * BT + 15).kind == fb.CONFIRMED
    assert f.cache_scale.value == 1.0 and f.index.capacity("a") == 100


def test_feedback_off_judges_but_corrects_nothing():
    f = fleet(feedback=False)
    f.index.record("a", chain(40))
    assert f.feedback("a", chain(40), 40 * BT, 0).kind == fb.OVERPREDICTED
    assert f.cache_scale.value == 1.0 and f.index.capacity("a") == 100


def test_an_instance_added_later_gets_the_learnt_scale():
    f = fleet()
    for _ in range(5):
        f.feedback("a", chain(40), 40 * BT, 0)
    f.add("c", 1600)
    assert f.index.capacity("c") == f.index.capacity("a") < 100
    assert f.estimated_capacity_tokens("c") == int(1600 * f.cache_scale.value)


def test_unknown_instance_is_ignored():
    f = fleet()
    assert f.feedback("gone", chain(4), 4 * BT, 0).kind == fb.OVERPREDICTED
    assert f.cache_scale.value == 1.0


def test_overprediction_for_a_request_that_queued_behind_others_is_no_evidence():
    """A busy engine evicts free blocks to admit the requests ahead of a new one: that says nothing about the
    size of its cache, so it must not shrink the model (it used to, and the index then forgot live chats)."""
    f = fleet()
    f.index.record("a", chain(40))
    v = f.feedback("a", chain(40), predicted_tokens=40 * BT, cached_tokens=0, queued_ahead=3)
    assert v.kind == fb.OVERPREDICTED and f.cache_scale.value == 1.0 and f.index.capacity("a") == 100
    f.feedback("a", chain(40), predicted_tokens=40 * BT, cached_tokens=0, queued_ahead=0)
    assert f.cache_scale.value < 1


def test_a_finished_request_refreshes_its_chain():
    """Engines free a finished sequence's blocks to the most-recent end of their LRU; the model does the same,
    so a conversation's history outlives chains that were sent before it finished."""
    f = fleet()  # 100 blocks per instance
    f.dispatched("a", 40 * BT, chain(40))
    f.dispatched("a", 40 * BT, chain(40, start=1000))
    f.finished("a", 40 * BT, blocks=chain(40))  # sent first, finished last
    f.dispatched("a", 40 * BT, chain(40, start=2000))  # 120 blocks: 20 must go
    depths = f.index.match_depths
    assert depths(chain(40)).get("a") == 40 and depths(chain(40, start=1000)).get("a", 0) < 40
    f.finished("a", 40 * BT, got_first_token=False, blocks=chain(40, start=5000))  # failed: never held
    assert depths(chain(40, start=5000)) == {}


def test_dispatched_says_how_many_requests_wait_ahead_for_their_first_token():
    f = fleet()
    assert [f.dispatched("a", 10) for _ in range(3)] == [0, 1, 2]
    f.first_token("a", 10)
    assert f.dispatched("a", 10) == 2 and f.dispatched("b", 10) == 0 and f.dispatched("gone", 10) == 0
