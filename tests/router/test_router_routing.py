"""The shell's routing step without HTTP: any body gives a key or a 400, and the books always balance."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmroute.core.lifecycle import Lifecycle, OutOfOrder
from warmroute.core.routing_key import ROUTED_PATHS, RoutingKey
from warmroute.core.strategies import CACHE_HIT, Decision
from warmroute.router.errors import ApiError
from warmroute.router.metrics import Metrics
from warmroute.router.routing import Router
from warmroute.router.settings_load import load_settings

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["model", "messages", "prompt", "input", "role", "content", "tools", "text", "type",
                         "instructions", "cache_salt", "user"]) | st.text(max_size=5), inner, max_size=5),
    max_leaves=20)


def make_router(**overrides) -> Router:
    s = load_settings({"backends": ["a=http://127.0.0.1:1", "b=http://127.0.0.1:2"], **overrides}, env={})
    return Router(s, Metrics(s.strategy, ["a", "b"]))


def send(router: Router, decision: Decision, defer_record: bool = False, key: RoutingKey | None = None) -> Lifecycle:
    """A request sent at once (past the queue): its lifecycle, dispatched."""
    life = router.open()
    life.keyed(key)
    life.admit(decision, 0.0, queue=False)
    router.dispatch(life, decision, defer_record)
    return life


async def admit(router: Router, key: RoutingKey | None, decision: Decision, priority: int = 0, tenant: str = "",
                size_bytes: int = 0) -> tuple[Decision, float]:
    """Router.admit for a new request of this key, tenant and priority."""
    life = router.open()
    life.keyed(key, tenant, priority)
    return await router.admit(life, decision, size_bytes)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(sorted(ROUTED_PATHS)), body=json_values)
def test_any_json_body_gives_a_key_or_a_400(path, body):
    router = make_router()
    try:
        key, decision = router.route(path, json.dumps(body).encode(), None)
    except ApiError as exc:
        assert exc.status == 400 and exc.kind == "invalid_request_error"
        return
    assert decision.instance in ("a", "b")


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=200))
def test_any_bytes_give_a_key_or_a_400(raw):
    router = make_router()
    try:
        router.route("/v1/chat/completions", raw, None)
    except ApiError as exc:
        assert exc.status == 400


def test_lives_balance_the_books():
    router = make_router()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4000}]}).encode()
    key, decision = router.route("/v1/chat/completions", body, None)
    inst = router.fleet.instances[decision.instance]
    life = send(router, decision)
    assert inst.inflight == 1 and inst.queued_prefill_tokens == decision.uncached_tokens > 0
    life.first_token()
    with pytest.raises(OutOfOrder):  # a second first token is refused, and counts nothing
        life.first_token()
    assert inst.queued_prefill_tokens == 0
    life.finish()
    with pytest.raises(OutOfOrder):
        life.finish()
    assert inst.inflight == 0
    # cache_aware records the prefix, so the same prompt now matches where it went
    _, again = router.route("/v1/chat/completions", body, None)
    assert again.instance == decision.instance and again.matched_tokens > 0


def test_the_other_replicas_hear_of_a_chain_when_sent_and_again_when_finished():
    """The refresh at finish (a finished sequence's blocks become the engine's most recent) is published too,
    or the other replicas / workers age a long answer's history from when it was sent; a request that never
    got its first token is not refreshed."""

    class Shared:  # what SharedIndex and WorkerLinks receive from the request path
        def __init__(self) -> None:
            self.calls: list[tuple[str, str, int]] = []

        def recorded(self, name, blocks) -> None:
            self.calls.append(("recorded", name, len(blocks)))

        def forgotten(self, name, blocks) -> None:
            self.calls.append(("forgotten", name, len(blocks)))

    router = make_router()
    router.shared = shared = Shared()
    body = json.dumps({"model": "m", "prompt": "w" * 4000}).encode()
    _, decision = router.route("/v1/completions", body, None)
    life = send(router, decision)
    assert shared.calls == [("recorded", decision.instance, len(decision.blocks))]
    life.first_token()
    life.finish()
    assert shared.calls == [("recorded", decision.instance, len(decision.blocks))] * 2
    send(router, decision).finish()  # no first token: nothing to refresh
    assert len(shared.calls) == 3


async def test_a_deferred_record_lands_on_the_next_loop_turn_unless_the_request_failed_first():
    router = make_router()
    body = json.dumps({"model": "m", "prompt": "v" * 4000}).encode()
    _, decision = router.route("/v1/completions", body, None)
    life = send(router, decision, defer_record=True)
    assert router.fleet.instances[decision.instance].inflight == 1  # the books at once
    assert router.fleet.index.entries() == 0  # the chain on the next turn, once the request is on its way
    await asyncio.sleep(0)
    assert router.fleet.index.entries(decision.instance) == len(decision.blocks)
    life.first_token()
    life.finish()

    other = make_router()
    _, decision = other.route("/v1/completions", body, None)
    send(other, decision, defer_record=True).finish()  # failed before the loop came round (no first byte)
    await asyncio.sleep(0)
    assert other.fleet.index.entries() == 0


def test_unrecord_forgets_a_prefix_that_never_arrived():
    router = make_router()
    body = json.dumps({"model": "m", "prompt": "y" * 4000}).encode()
    _, decision = router.route("/v1/completions", body, None)
    send(router, decision).finish()
    router.unrecord(decision)
    _, again = router.route("/v1/completions", body, None)
    assert again.matched_tokens == 0


@pytest.mark.parametrize("strategy", ["prefix", "session", "least_loaded", "round_robin", "random"])
def test_strategies_without_an_index_record_nothing(strategy):
    router = make_router(strategy=strategy)
    body = json.dumps({"model": "m", "prompt": "z" * 4000}).encode()
    _, decision = router.route("/v1/completions", body, "session-1")
    send(router, decision).finish()
    assert router.fleet.index.entries() == 0


def _choice_for_a_prefix_only_a_holds(swamped: float = 0.0, scale: float = 1.0, **settings) -> str:
    """Where the router sends a prompt whose prefix only `a` holds, with a queue there worth 4 prompts (and
    prompts in flight there needing `swamped` x its KV cache), `b` idle; `scale`: the capacity factor feedback
    learnt."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "tell me about caches " * 60}]})
    router = make_router(**settings)
    key = router.key_of("/v1/chat/completions", body.encode(), None)
    router.fleet.index.record("a", key.blocks())
    a = router.fleet.instances["a"]
    a.queued_prefill_tokens, a.inflight = 4 * key.tokens, 4
    a.inflight_prompt_tokens = int(swamped * a.kv_capacity_tokens)
    router.fleet.cache_scale.value = scale
    assert router.strategy.settings.cache_aware.shared_miss_weight == 1.0
    return router.decide(key).instance


def test_miss_weights_reach_the_strategy_and_change_its_choice():
    """The default private miss weight (16) keeps the request on `a`; configured down to 2, it goes to `b`."""
    assert _choice_for_a_prefix_only_a_holds() == "a"
    assert _choice_for_a_prefix_only_a_holds(miss_weight=2.0) == "b"


def test_sticky_kv_limit_reaches_the_strategy_and_changes_its_choice():
    """`a` swamped (3.5x its KV cache in flight): by default (3) the request goes to `b`; with the limit raised
    to 1000 it stays on `a`; at 2x it stays by default, and goes with the limit lowered to 1.75."""
    assert _choice_for_a_prefix_only_a_holds(swamped=3.5) == "b"
    assert _choice_for_a_prefix_only_a_holds(swamped=3.5, sticky_kv_limit=1000.0) == "a"
    assert _choice_for_a_prefix_only_a_holds(swamped=2.0) == "a"
    assert _choice_for_a_prefix_only_a_holds(swamped=2.0, sticky_kv_limit=1.75) == "b"


def test_kv_pressure_counts_the_capacity_feedback_learnt():
    """The books count the router's tokens, the capacity the engine's: with feedback's factor at 1.5 (1.5 router
    tokens fit where the configuration says one), 3.5x the configured capacity is 2.3x the learnt one: kept."""
    assert _choice_for_a_prefix_only_a_holds(swamped=3.5, scale=1.5) == "a"


def _swamped_router(**settings):
    """A router whose `a` holds a conversation (a prompt of ~300 tokens) and has three fully cached prompts of
    4,600 tokens in flight, 1.38x its KV cache: the conversation's next turn, kept on `a`, would take it past
    hold_kv_limit (1.4)."""
    router = make_router(**{"kv_capacity_tokens": 10_000, "hold_kv_limit": 1.4, **settings})
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "tell me about caches " * 60}]})
    key = router.key_of("/v1/chat/completions", body.encode(), None)
    router.fleet.index.record("a", key.blocks())
    lives = [send(router, Decision("a", CACHE_HIT, 4_600, 4_600, (), True)) for _ in range(3)]
    return router, key, lives


def _metric(router, name: str, **labels) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_held_request_waits_for_room_and_goes_when_a_request_finishes():
    """The former hold, now a case of the admission queue: the conversation waits for its own instance."""
    router, key, lives = _swamped_router()
    decision = router.decide(key)
    assert decision.instance == "a" and decision.private
    held = asyncio.create_task(admit(router, key, decision))
    await asyncio.sleep(0.05)
    assert not held.done() and _metric(router, "warmroute_queue_waiting", priority="0", tenant="") == 1
    lives[0].finish()  # 0.87x + the prompt: room now
    sent, waited = await asyncio.wait_for(held, 1.0)
    assert sent.instance == "a" and sent.private and 0.05 <= waited < 1.0
    assert _metric(router, "warmroute_queue_waiting", priority="0", tenant="") == 0
    assert _metric(router, "warmroute_admissions_total", how="kv") == 1
    assert _metric(router, "warmroute_queue_wait_seconds_count", priority="0", tenant="", outcome="admitted") == 1
    assert router.admission.idle()


async def test_a_held_request_goes_elsewhere_after_hold_timeout():
    """Past hold_timeout the KV limit no longer binds it: `a` still has request slots, and takes it."""
    router, key, _ = _swamped_router(hold_timeout=0.3, hold_keep=100.0)
    router.fleet.mean_ttft_s = 1.0
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent, waited = await asyncio.wait_for(admit(router, key, router.decide(key)), 2.0)
    assert sent.instance == "a" and 0.29 <= waited <= loop.time() - start < 1.0


async def test_a_client_that_leaves_while_queued_leaves_nothing_behind():
    router, key, lives = _swamped_router()
    held = asyncio.create_task(admit(router, key, router.decide(key)))
    await asyncio.sleep(0.05)
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert _metric(router, "warmroute_queue_waiting", priority="0", tenant="") == 0
    assert _metric(router, "warmroute_sheds_total", reason="client_closed", priority="0") == 1
    for life in lives:
        life.finish()
    a = router.fleet.instances["a"]
    assert a.inflight == 0 and a.inflight_prompt_tokens == 0 and router.admission.idle()


async def test_hold_kv_limit_1000_or_admission_off_never_waits():
    for settings in ({"hold_kv_limit": 1000.0}, {"admission": False, "hold_kv_limit": 1.4}):
        router, key, _ = _swamped_router(**settings)
        decision = router.decide(key)
        assert await asyncio.wait_for(admit(router, key, decision), 0.1) == (decision, 0.0)


async def test_a_full_fleet_queues_then_refuses_with_429_past_its_bounds_and_deadline():
    router = make_router(concurrency_threshold=1, engine_capacity=1, queue_max_requests=1, queue_timeout=0.3)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}).encode()
    key = router.key_of("/v1/chat/completions", body, None)
    lives = [send(router, Decision(n, CACHE_HIT)) for n in "ab"]  # a and b each at the threshold
    first = asyncio.create_task(admit(router, key, router.decide(key), size_bytes=len(body)))
    await asyncio.sleep(0.02)
    with pytest.raises(ApiError) as full:
        await admit(router, key, router.decide(key))
    assert full.value.status == 429 and full.value.headers["Retry-After"] == "1"
    with pytest.raises(ApiError) as late:
        await asyncio.wait_for(first, 2.0)
    assert late.value.status == 429 and "timeout_s" in late.value.message
    assert _metric(router, "warmroute_sheds_total", reason="queue_full", priority="0") == 1
    assert _metric(router, "warmroute_sheds_total", reason="deadline", priority="0") == 1
    for life in lives:
        life.finish()
    assert router.admission.idle() and all(i.inflight == 0 for i in router.fleet.instances.values())


async def test_a_higher_priority_request_takes_a_lower_ones_place_in_a_full_queue():
    router = make_router(concurrency_threshold=1, engine_capacity=1, queue_max_requests=1)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}).encode()
    key = router.key_of("/v1/chat/completions", body, None)
    lives = [send(router, Decision(n, CACHE_HIT)) for n in "ab"]
    low = asyncio.create_task(admit(router, key, router.decide(key), priority=-1))
    await asyncio.sleep(0.02)
    high = asyncio.create_task(admit(router, key, router.decide(key), priority=1))
    with pytest.raises(ApiError) as refused:
        await asyncio.wait_for(low, 1.0)
    assert refused.value.status == 429 and "higher-priority" in refused.value.message
    lives[0].finish()
    sent, waited = await asyncio.wait_for(high, 1.0)
    assert waited > 0 and router.admission.reserved == {}
    lives[1].finish()
    assert router.admission.idle()


async def test_waiters_get_503_when_every_instance_goes_down():
    router = make_router(concurrency_threshold=1, engine_capacity=1)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}).encode()
    key = router.key_of("/v1/chat/completions", body, None)
    for n in "ab":
        send(router, Decision(n, CACHE_HIT))
    waiting = asyncio.create_task(admit(router, key, router.decide(key)))
    await asyncio.sleep(0.02)
    for inst in router.fleet.instances.values():
        inst.healthy = False
    with pytest.raises(ApiError) as gone:
        await asyncio.wait_for(waiting, 2.0)
    assert gone.value.status == 503 and router.admission.idle()
