"""When the router holds requests for an engine (#32): only once that engine is full, by its own account or the
operator's; the ConcurrencyThreshold only moves requests to an instance with room."""

from __future__ import annotations


from warmroute.core.admission import (BUSY, MIN_LEARNED_LIMIT, UNBOUNDED, Admission,
                                      AdmissionSettings)
from warmroute.core.decision import CACHE_HIT, OVERLOAD_SPILL
from warmroute.core.engine_capacity import (GROWTH, KV_HIGH_WATER, MIN_BATCH, PEAK_WINDOW, SUSTAINED,
                                            EngineCapacity)
from warmroute.core.stages import Handles
from warmroute.core.strategies import StrategySettings, make_strategy

from fleet_helpers import SYSTEM, fleet, key


def test_an_engine_shows_no_limit_until_it_queues_at_its_batch_on_consecutive_scrapes():
    cap = EngineCapacity()
    cap.observe(waiting=0, running=250, at_limit=False)
    cap.observe(waiting=3, running=250, at_limit=False)  # one scrape may catch a step in passing
    assert cap.learned is None
    cap.observe(waiting=0, running=250, at_limit=False)
    cap.observe(waiting=3, running=250, at_limit=False)
    assert cap.learned is None
    cap.observe(waiting=2, running=250, at_limit=False)
    assert cap.learned == 250


def test_requests_waiting_while_the_engine_runs_fewer_than_its_peak_show_no_limit():
    """Requests wait while each step's token budget goes to prefilling long prompts: an engine that ran 250 now runs
    10, and a cold one prefills its first 8, scrape after scrape. Neither batch is full; a limit learned there
    held a 256-request engine at 32-49 in the simulated 2x surge (benchmarks/surge_placement.py)."""
    cap = EngineCapacity()
    cap.observe(waiting=0, running=250, at_limit=False)
    for _ in range(5):
        cap.observe(waiting=3, running=10, at_limit=False)
    assert cap.learned is None
    cold = EngineCapacity()
    for _ in range(5):
        cold.observe(waiting=35, running=8, at_limit=False)
    assert cold.learned is None
    for _ in range(SUSTAINED):  # at its peak, past MIN_BATCH, requests still waiting: that is its batch
        cold.observe(waiting=20, running=MIN_BATCH, at_limit=False)
    assert cold.learned is None  # (the first of those grew the batch: no evidence yet)
    cold.observe(waiting=20, running=MIN_BATCH, at_limit=False)
    assert cold.learned == MIN_BATCH


def test_an_engine_whose_batch_grows_while_requests_wait_is_not_full():
    """A burst of long prompts: requests wait while each step's token budget goes to prefill, and the batch grows
    as they are admitted (a cold fleet taking 192 clients at once: 8, 18, 29, 45 running)."""
    cap = EngineCapacity()
    for running, waiting in ((8, 37), (18, 27), (29, 16), (45, 0)):
        cap.observe(waiting=waiting, running=running, at_limit=False)
    assert cap.learned is None


def test_a_kv_cache_held_by_running_requests_is_full_at_what_it_runs():
    cap = EngineCapacity()
    cap.observe(waiting=0, running=120, at_limit=False)
    for _ in range(SUSTAINED):
        cap.observe(waiting=0, running=60, at_limit=False, kv_usage=KV_HIGH_WATER)
    assert cap.learned == 60  # more would evict the cached prefixes the next requests need


def test_the_peak_is_taken_over_recent_scrapes_only():
    cap = EngineCapacity()
    cap.observe(waiting=0, running=500, at_limit=False)
    for _ in range(PEAK_WINDOW):
        cap.observe(waiting=0, running=40, at_limit=False)
    for _ in range(SUSTAINED):
        cap.observe(waiting=5, running=40, at_limit=False)
    assert cap.learned == 40


def test_a_learned_limit_grows_when_the_engine_shows_no_queue_at_it_and_falls_back_when_it_does():
    cap = EngineCapacity()
    for _ in range(SUSTAINED):
        cap.observe(waiting=4, running=32, at_limit=False)
    assert cap.learned == 32
    cap.observe(waiting=0, running=32, at_limit=False)  # the router did not keep it full: no evidence
    cap.observe(waiting=0, running=32, at_limit=False)
    assert cap.learned == 32
    for _ in range(SUSTAINED):
        cap.observe(waiting=0, running=32, at_limit=True)
    assert cap.learned == round(32 * GROWTH)
    for _ in range(SUSTAINED):
        cap.observe(waiting=2, running=32, at_limit=True)
    assert cap.learned == 32


def test_a_learned_limit_rises_at_once_to_a_batch_the_engine_is_seen_running():
    """A cold start's scrapes can catch one long prefill step twice, the batch at 94 and requests waiting: a limit of
    94. The engine then runs 167, then 224 at once (requests sent before the limit was known): its batch holds that
    many, and a limit of 94 would hold it far below them while it drains. The limit follows what it runs at once,
    not GROWTH's climb."""
    cap = EngineCapacity()
    for _ in range(SUSTAINED + 1):
        cap.observe(waiting=104, running=94, at_limit=False)
    assert cap.learned == 94
    cap.observe(waiting=104, running=167, at_limit=True)
    assert cap.learned == 167
    cap.observe(waiting=47, running=224, at_limit=True)
    assert cap.learned == 224
    cap.observe(waiting=0, running=48, at_limit=False)  # running fewer says nothing about its batch
    assert cap.learned == 224


def test_a_stated_capacity_is_never_learned_over():
    cap = EngineCapacity(stated=64)
    for _ in range(5):
        cap.observe(waiting=10, running=8, at_limit=True)
    assert cap.stated == 64 and cap.learned is None


def test_a_learned_limit_never_holds_a_few_long_prefills_back():
    f = fleet(1)
    (a,) = f.instances
    for _ in range(SUSTAINED):
        f.engine_load(a, waiting=5, running=3, kv_usage=0.5)  # queueing at 3 running: busy with prefill
    adm = Admission(AdmissionSettings(concurrency_threshold=32), f)
    assert f.instances[a].capacity.learned is None and adm.limit(f.instances[a]) is None
    f.instances[a].capacity.learned = 3  # (where its KV cache filled at 3: still held at no fewer than a few)
    assert adm.limit(f.instances[a]) == MIN_LEARNED_LIMIT
    f.engine_load(a, waiting=5, running=40, kv_usage=0.5)  # growing: admitting
    for _ in range(SUSTAINED):
        f.engine_load(a, waiting=5, running=40, kv_usage=0.5)
    learned = f.instances[a].capacity.learned
    assert learned == 40 and adm.limit(f.instances[a]) == 40  # by default the engine queues nothing past it
    # with engine_queue_share, that share more (not where the KV cache filled)
    assert Admission(AdmissionSettings(concurrency_threshold=32, engine_queue_share=0.25), f).limit(
        f.instances[a]) == 50
    f.instances[a].capacity.kv_bound = True
    assert Admission(AdmissionSettings(concurrency_threshold=32, engine_queue_share=0.25), f).limit(
        f.instances[a]) == 40


def _cache_aware_with_queue(f, threshold: int, **adm):
    """cache_aware as the router builds it with admission on: it sees how long a request would wait for a slot."""
    queue = Admission(AdmissionSettings(concurrency_threshold=threshold, **adm), f)
    s = make_strategy("cache_aware", StrategySettings(concurrency_threshold=threshold),
                      handles=Handles(slot_wait=queue.slot_wait))
    return s, queue


def test_at_the_threshold_a_request_spills_to_an_instance_with_room():
    """(a) The instance holding the prefix has the threshold in flight, its engine has room: the request goes to
    the other instance at once (the reference's overload spill), and does not wait."""
    f = fleet(2)
    a, b = sorted(f.instances)
    s, queue = _cache_aware_with_queue(f, threshold=4)
    k = key(SYSTEM)
    f.index.record(a, k.blocks())
    assert s.choose(k, f).instance == a
    f.instances[a].inflight = 4
    d = s.choose(k, f)
    assert d.instance == b and d.reason == OVERLOAD_SPILL and queue.waiter_for(d, 0.0) is None


def test_a_full_engine_is_waited_for_only_while_that_is_sooner_than_a_prefill_elsewhere():
    """(b) Every engine full (engine_capacity 4, under the threshold): the request is placed for its cache and
    waits in the router for that engine. Once another engine has a slot, the request goes where it would
    be answered sooner: waiting for a slot at the holder (its line over the rate slots free: 4 per mean request's
    10 s here) or its whole prefill at the other (about 0.1 s)."""
    f = fleet(2)
    a, b = sorted(f.instances)
    for inst in f.instances.values():
        inst.capacity.stated, inst.inflight = 4, 4
    s, queue = _cache_aware_with_queue(f, threshold=64)
    k = key(SYSTEM)
    f.index.record(a, k.blocks())
    d = s.choose(k, f)
    assert d.instance == a and d.reason == CACHE_HIT
    w = queue.waiter_for(d, 0.0)
    assert w is not None and w.why == BUSY == "engine_full" and w.pin == a
    queue.offer(w)
    f.instances[b].inflight = 3  # a slot at b
    assert queue.slot_wait(f.instances[b]) == 0.0
    f.mean_service_s = 0.1  # slots free fast at a: waiting there is sooner than a prefill at b
    assert s.choose(k, f).instance == a
    f.mean_service_s = 10.0  # slowly: the prefill at b is sooner
    assert queue.slot_wait(f.instances[a]) == 2 * 10.0 / 4  # second in line (one waits already)
    d2 = s.choose(k, f)
    assert d2.instance == b and d2.reason == OVERLOAD_SPILL and queue.waiter_for(d2, 0.0) is None
    queue.cancel(w)


def test_an_engine_reporting_a_queue_is_not_sent_more_while_another_has_room():
    """(c) Both instances are past the threshold (32); the one holding the prefix reports requests waiting on two
    scrapes at 40 running: it is full at 40, so the request goes to the other, whose engine reports no queue."""
    f = fleet(2)
    a, b = sorted(f.instances)
    s, queue = _cache_aware_with_queue(f, threshold=32)
    f.mean_service_s = 20.0
    k = key(SYSTEM)
    f.index.record(a, k.blocks())
    f.instances[a].inflight, f.instances[b].inflight = 40, 35
    assert s.choose(k, f).instance == a  # all past the threshold, nobody full yet: the cost keeps its cache
    for _ in range(SUSTAINED):
        f.engine_load(a, waiting=6, running=40, kv_usage=0.9)
        f.engine_load(b, waiting=0, running=35, kv_usage=0.5)
    assert queue.spare(f.instances[a]) <= 0 and queue.spare(f.instances[b]) == UNBOUNDED
    d = s.choose(k, f)
    assert d.instance == b and d.reason == OVERLOAD_SPILL and queue.waiter_for(d, 0.0) is None


def test_a_single_engine_past_the_threshold_is_never_held_for():
    """(d), in the core: one engine, 100 in flight, threshold 64, no capacity stated or learned: the next request
    goes at once."""
    f = fleet(1)
    (a,) = f.instances
    s, queue = _cache_aware_with_queue(f, threshold=64)
    f.instances[a].inflight = 100
    d = s.choose(key(SYSTEM), f)
    assert d.instance == a and queue.waiter_for(d, 0.0) is None


def test_a_saturated_fleet_keeps_a_shared_prefix_where_it_is_cached():
    """Every engine full: a prompt whose prefix two instances hold (a shared miss, weighed 1 while any has room)
    waits in a longer line there rather than computing its prefix at the third. The shorter line would only move
    the wait onto the requests behind; the prefill repeated is compute the fleet lacks. With the weight off, the
    shorter line wins. While an instance has a slot, a hot prefix (a third of the recent requests or more, 3
    instances) is copied there to spread its load; with copy_only_hot, one that is not hot stays: a copy spreads
    nothing."""
    def choice(weight: float, free_slot: bool = False, hot: bool = False, copy_only_hot: bool = True) -> str:
        f = fleet(3)
        a, b, c = sorted(f.instances)
        for inst in f.instances.values():
            inst.capacity.stated, inst.inflight = 4, 4
        queue = Admission(AdmissionSettings(concurrency_threshold=64), f)
        settings = StrategySettings(concurrency_threshold=64,
                                    cache_aware={"saturated_miss_weight": weight, "copy_only_hot": copy_only_hot})
        s = make_strategy("cache_aware", settings, handles=Handles(slot_wait=queue.slot_wait))
        f.mean_service_s = 1.0  # each waiter ahead adds 0.25 s: a and b 0.5 s longer than c, a prefill ~0.1 s
        for name in (a, b):
            f.index.record(name, key(SYSTEM).blocks())
            queue.capacity.pin(name)
            queue.capacity.pin(name)
        if hot:
            for _ in range(4):  # decisions for this prefix alone: all of the recent requests
                s.choose(key(SYSTEM), f)
        if free_slot:
            f.instances[c].inflight = 3
        return s.choose(key(SYSTEM), f).instance

    assert choice(16.0) in ("i0", "i1")
    assert choice(0.0) == "i2"
    assert choice(16.0, free_slot=True, hot=True) == "i2"  # not saturated: a slot now beats a wait
    assert choice(16.0, free_slot=True) in ("i0", "i1")  # not hot: no load to spread
    assert choice(0.0, free_slot=True) == "i2"
    assert choice(16.0, free_slot=True, copy_only_hot=False) == "i2"  # the default: a slot beats a wait
