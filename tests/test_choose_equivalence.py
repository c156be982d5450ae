"""CacheAwareStrategy.choose computes its rule in one scan (compiled where a C compiler was found, else list
comprehensions); these properties check that both versions decide exactly as the plain loop below (the rule as
first written) for random fleets.

If the rule itself changes, change `reference_choose` the same way: it is the readable statement of the rule.
"""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from warmroute.core import rendezvous
from warmroute.core.engine_load import EngineLoad, backlog_tokens, foreign_requests
from warmroute.core import strategies
from warmroute.core.fleet import RECENT_WINDOW, Fleet, FleetSettings, Instance
from warmroute.core.routing_key import RoutingKey, key_for_json
from warmroute.core.strategies import (CACHE_HIT, HOT_SPREAD, KV_SPILL, CacheAwareStrategy, Decision, NoInstanceAvailable,
                                       OVERLOAD_SPILL, StrategySettings)


def reference_choose(strategy: CacheAwareStrategy, key: RoutingKey, fleet: Fleet) -> Decision:
    """cache_aware's rule as one straightforward loop over the routable instances (see its docstring)."""
    up = fleet.routable()
    if not up:
        raise NoInstanceAvailable("no healthy instance")
    s = strategy.settings
    blocks = key.blocks(s.block_bytes)
    depths = strategy.match_depths(blocks, fleet) if blocks else {}
    block_tokens = s.block_bytes // 4
    prompt = key.tokens

    loads = [(i.inflight + foreign_requests(i.engine) if i.engine is not None else i.inflight, i) for i in up]
    cap = min(s.concurrency_threshold,
              math.ceil((1 + s.balance_factor) * (sum(n for n, _ in loads) + 1) / len(up)) + s.balance_slack)
    costs: list[tuple[float, Instance]] = []
    deepest = max(depths.values(), default=0)
    private = deepest > 0 and sum(1 for d in depths.values() if d == deepest) == 1
    holder = fleet.instances.get(next(n for n, d in depths.items() if d == deepest)) if private else None
    swamped = False
    if holder is not None:  # sticky only while the prompts in flight there fit sticky_kv_limit x its KV cache
        demand = holder.inflight_prompt_tokens
        if holder.engine is not None and holder.inflight:  # other routers' requests, each the size of ours
            demand += foreign_requests(holder.engine) * holder.inflight_prompt_tokens / holder.inflight
        swamped = demand / holder.kv_capacity_tokens > s.sticky_kv_limit
        private = not swamped
    alpha = s.miss_weight if private else s.shared_miss_weight
    # A hot prefix (its longest match's last block on >= 1/N of recent requests) skips instances sent more than
    # (1+δ) x the mean of recent requests + slack, unless every candidate was.
    under = [i for n, i in loads if not n >= cap]
    fair = under
    hot = bool(depths and blocks
               and strategy.popularity.share(blocks[min(deepest, len(blocks)) - 1]) * len(up) >= 1.0)
    if hot:
        share_cap = ((1 + s.hot_balance_factor) * sum(i.recent for i in up) / len(up)
                     + s.hot_balance_slack * fleet.recent_unit.value)
        fair = [i for i in under if i.recent <= share_cap] or under
    for n, i in loads:
        if n >= cap or i not in fair:
            continue
        queued = i.queued_prefill_tokens
        if i.engine is not None:
            queued += backlog_tokens(i.engine, prompt, i.kv_capacity_tokens, fleet.mean_uncached_tokens)
        depth = depths.get(i.name, 0)
        miss = alpha * max(0, prompt - depth * block_tokens) if depth else alpha * prompt
        costs.append(((queued + miss) / i.prefill_tokens_per_s, i))
    if not costs:
        inst = min(up, key=lambda i: (i.inflight, i.queued_prefill_tokens, i.name))
        return strategy._decision(inst, OVERLOAD_SPILL, depths, block_tokens, prompt, blocks)

    best = min(c for c, _ in costs)
    slack = alpha * block_tokens / min(i.prefill_tokens_per_s for _, i in costs)
    tied = [i for c, i in costs if c <= best + slack]
    if len(tied) > 1 and s.cold_to_least_loaded:
        least = min(i.inflight for i in tied)
        tied = [i for i in tied if i.inflight <= least + s.balance_slack]
    if len(tied) == 1:
        name = tied[0].name
    else:
        hash_key = key.prefix_hash(s.prefix_length)
        name = max((i.name for i in tied), key=lambda n: rendezvous.weight(hash_key, n))
    inst = fleet.instances[name]
    reason = strategy._reason(inst, depths)
    if swamped and reason == OVERLOAD_SPILL:
        reason = KV_SPILL  # the one holder was swamped, so the prompt weighed its miss as a shared one
    elif hot and reason == OVERLOAD_SPILL and any(i.recent > share_cap for i in up if depths.get(i.name) == deepest):
        reason = HOT_SPREAD  # the hot-prefix guard, not the queue, kept a holder of the deepest match out
    # Kept on the one holder of its prefix at the private weight: it may wait in the router (core/admission.py).
    return strategy._decision(inst, reason, depths, block_tokens, prompt, blocks, private and reason == CACHE_HIT)


class GivenDepths(CacheAwareStrategy):
    """match_depths overridden, as the simulator's oracle does: the depths are part of the drawn input."""

    def __init__(self, settings: StrategySettings, depths: dict[str, int]) -> None:
        super().__init__(settings)
        self.depths = depths

    def match_depths(self, blocks: list[int], fleet: Fleet) -> dict[str, int]:
        return dict(self.depths)


# Small value sets, so that equal costs, equal loads and loads at the guard's cap are common.
tokens = st.one_of(st.sampled_from([0, 0.0, 16, 100, 1_000, 8_000]), st.integers(0, 20_000),
                   st.floats(0, 50_000, allow_nan=False))
engine_loads = st.one_of(st.none(), st.builds(
    EngineLoad,
    waiting=st.one_of(st.none(), st.integers(0, 10)),
    running=st.one_of(st.none(), st.integers(0, 10)),
    kv_usage=st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0]), st.floats(0, 1)),
    foreign_requests=st.one_of(st.sampled_from([0.0, 1.0, 3.0]), st.floats(0, 20, allow_nan=False)),
    foreign_waiting=st.one_of(st.sampled_from([0.0, 2.0]), st.floats(0, 10, allow_nan=False)),
))
instances = st.fixed_dictionaries({
    "inflight": st.integers(0, 12),
    "prompt_tokens": st.sampled_from([0, 500, 1_750, 2_000, 200_000]),  # in flight (with kv 1,000: 1.75 x)
    "queued": tokens,
    "rate": st.sampled_from([10_000.0, 10_000, 20_000.0, 2_500.5]),
    "kv": st.sampled_from([1_000, 100_000, 10**8]),
    "healthy": st.booleans().filter(lambda b: b) | st.booleans(),  # mostly healthy
    "draining": st.sampled_from([False, False, False, True]),
    "engine": engine_loads,
    "depth": st.one_of(st.just(0), st.integers(0, 600)),
    "recent": st.one_of(st.sampled_from([0.0, 1.0, 5.0, 20.0]), st.floats(0, 100, allow_nan=False)),
})
strategy_settings = st.builds(
    StrategySettings,
    prefix_length=st.sampled_from([1024, 4096]),
    concurrency_threshold=st.sampled_from([1, 2, 4, 32, 1024]),
    balance_factor=st.sampled_from([0.0, 0.25, 1.0, 100.0]),
    balance_slack=st.sampled_from([0, 2, 4]),
    cold_to_least_loaded=st.booleans(),
    miss_weight=st.sampled_from([0.0, 1.0, 2.0, 2, 3.5, 16.0]),
    shared_miss_weight=st.sampled_from([0.0, 1.0, 2.0]),
    sticky_kv_limit=st.sampled_from([0.0, 1.75, 1000.0]),
    block_bytes=st.sampled_from([64, 128]),
    hot_balance_factor=st.sampled_from([0.0, 0.2, 1.0]),
    hot_balance_slack=st.sampled_from([0.0, 2.0]),
)


def make_fleet(drawn: list[dict], mean_uncached: float) -> tuple[Fleet, dict[str, int]]:
    f = Fleet(FleetSettings())
    depths = {}
    for n, d in enumerate(drawn):
        inst = f.add(f"i{n}", d["kv"], d["rate"])
        inst.inflight, inst.queued_prefill_tokens = d["inflight"], d["queued"]
        inst.healthy, inst.draining, inst.engine = d["healthy"], d["draining"], d["engine"]
        inst.recent = d["recent"]
        inst.inflight_prompt_tokens = d["prompt_tokens"] if d["inflight"] else 0
        if d["depth"]:
            depths[inst.name] = d["depth"]
    f.mean_uncached_tokens = mean_uncached
    return f, depths


def outcome(choose, strategy, key, fleet):
    try:
        return choose(strategy, key, fleet)
    except NoInstanceAvailable:
        return "no instance"


SCANS = [strategies.scan_python] + ([strategies._scan.scan] if strategies._scan is not None else [])


@pytest.fixture(params=SCANS, ids=lambda f: "C" if f is not strategies.scan_python else "python")
def each_scan(request, monkeypatch):
    """Runs a test once with the Python scan and once with the compiled one (where it was built)."""
    monkeypatch.setattr(strategies, "scan", request.param)
    return request.param


def test_the_compiled_scan_is_built_where_required():
    assert strategies._scan is not None or os.environ.get("WARMROUTE_REQUIRE_NATIVE") != "1"
    assert strategies.scan is (strategies._scan.scan if strategies._scan is not None else strategies.scan_python)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.lists(instances, min_size=1, max_size=12), strategy_settings,
       st.text(min_size=0, max_size=3000), st.sampled_from([0.0, 500.0, 4321.5]),
       st.dictionaries(st.sampled_from(["gone", "i99"]), st.integers(1, 50), max_size=2),
       st.integers(0, 3), st.one_of(st.sampled_from([1.0, 0.05]), st.floats(0.001, 100)))
def test_choose_decides_as_the_reference_rule(each_scan, drawn, s, prompt, mean_uncached, stray_depths, hot,
                                              unit):
    f, depths = make_fleet(drawn, mean_uncached)
    f.recent_unit.value = unit
    depths.update(stray_depths)  # names the fleet does not know: ignored by both
    strategy = GivenDepths(s, depths)
    k = key_for_json("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": prompt}]})
    blocks = k.blocks(s.block_bytes)
    if depths and blocks:  # make its prefix popular (or not): `hot` requests for it out of 3
        prefix = blocks[min(max(depths.values()), len(blocks)) - 1]
        for n in range(3):
            strategy.popularity.add(prefix if n < hot else None, RECENT_WINDOW * len(drawn))
    expected = outcome(reference_choose, strategy, k, f)
    assert outcome(CacheAwareStrategy.choose, strategy, k, f) == expected


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(instances, min_size=2, max_size=12), strategy_settings, st.integers(1, 600),
       st.text(min_size=300, max_size=3000), st.one_of(st.sampled_from([1.0, 0.05]), st.floats(0.001, 100)))
def test_choose_for_a_hot_prefix_decides_as_the_reference_rule(each_scan, drawn, s, depth, prompt, unit):
    """A prefix on every recent request: the guard on recent requests applies."""
    f, depths = make_fleet(drawn, 500.0)
    f.recent_unit.value = unit
    depths["i0"] = depth
    strategy = GivenDepths(s, depths)
    k = key_for_json("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": prompt}]})
    blocks = k.blocks(s.block_bytes)
    strategy.popularity.add(blocks[min(max(depths.values()), len(blocks)) - 1], RECENT_WINDOW * len(drawn))
    expected = outcome(reference_choose, strategy, k, f)
    assert outcome(CacheAwareStrategy.choose, strategy, k, f) == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 64), st.integers(0, 2**64 - 1))
def test_idle_fleet_all_tied_matches_the_reference(each_scan, n, seed):
    """A cold prompt on an idle fleet: every instance ties and rendezvous picks among all of them."""
    f = Fleet(FleetSettings())
    for j in range(n):
        f.add(f"instance-{j}", 10**8)
    s = CacheAwareStrategy()
    k = key_for_json("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": f"{seed}"}]})
    expected = reference_choose(s, k, f)
    assert s.choose(k, f) == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 40), st.integers(0, 3)), max_size=40),
       st.integers(0, 3), st.integers(1, 40))
def test_choose_with_the_real_index_matches_the_reference(each_scan, records, prompt_id, prompt_blocks):
    """Depths from the prefix index itself (chains sharing prefixes, per-instance caps with eviction)."""
    f = Fleet(FleetSettings(index_max_bytes=400 * 8 * 60))  # 60 entries per instance: evictions happen
    for j in range(8):
        f.add(f"i{j}", 10**8)
    texts = [f"shared system prompt {p} " * 200 for p in range(4)]
    s = CacheAwareStrategy()
    for inst, n_blocks, p in records:
        f.index.record(f"i{inst}", key_for_json("/v1/completions", {"prompt": texts[p]}).blocks()[:n_blocks])
        f.instances[f"i{inst}"].inflight += 1
    k = key_for_json("/v1/completions", {"prompt": texts[prompt_id][:64 * prompt_blocks]})
    depths = f.index.match_depths(k.blocks())
    for _ in range(prompt_id if depths else 0):  # some prompts are hot; the busy instances' recent counts high
        s.popularity.add(k.blocks()[max(depths.values()) - 1], 8)
    for j, (inst, _, _) in enumerate(records):
        f.instances[f"i{inst}"].recent += j
    expected = reference_choose(s, k, f)
    assert s.choose(k, f) == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "i1", "instance-7", "é", ""]), max_size=12), st.integers(0, 2**70))
def test_rendezvous_top_and_order_match_max_and_sorted(names, key):
    """Duplicated names have equal weights: both keep the first of them, as max() and a stable sort do."""
    w = lambda n: rendezvous.weight(key, n)  # noqa: E731
    assert rendezvous.top(key, names) == max(names, key=w, default=None)
    assert rendezvous.top(key, iter(names)) == max(names, key=w, default=None)
    assert rendezvous.order(key, names) == sorted(names, key=w, reverse=True)


class OtherInstance(Instance):
    """Not exactly an Instance: the compiled scan reads its fields with getattr instead of at slot offsets."""

    __slots__ = ()


@settings(max_examples=300, deadline=None)
@given(st.lists(instances, min_size=1, max_size=12), st.sampled_from([0.0, 4321.5]), st.booleans())
def test_the_compiled_scan_reads_other_objects_as_python_does(drawn, mean, hot):
    if strategies._scan is None:
        pytest.skip("the compiled scan was not built here")
    up = []
    for n, d in enumerate(drawn):
        inst = (OtherInstance if n % 2 else Instance)(f"i{n}", d["kv"], d["rate"])
        inst.inflight, inst.queued_prefill_tokens, inst.engine, inst.recent = (d["inflight"], d["queued"],
                                                                               d["engine"], d["recent"])
        up.append(inst)
    miss = {"i0": 10.0, "i1": 0.0}
    args = (up, miss, 5_000.0, 1_000, mean, 8, 0.5, 2, 0.2 if hot else -1.0, 1.0, 16.0, 2)
    assert strategies._scan.scan(*args) == strategies.scan_python(*args)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([True, False, 1, 0]), st.sampled_from([True, False, 1, 0]),
                          st.booleans()), min_size=0, max_size=12),
       st.one_of(st.none(), st.frozensets(st.sampled_from([f"i{n}" for n in range(14)]))))
def test_the_compiled_routable_filter_matches_python(drawn, serving):
    from warmroute.core import fleet as fleet_module

    if fleet_module.routable_of is fleet_module.routable_python:
        pytest.skip("the compiled scan was not built here")
    instances = {}
    for n, (healthy, draining, other) in enumerate(drawn):
        inst = (OtherInstance if other else Instance)(f"i{n}", 1000)
        inst.healthy, inst.draining = healthy, draining
        instances[inst.name] = inst
    got = fleet_module.routable_of(instances, serving)
    want = fleet_module.routable_python(instances, serving)
    assert [id(i) for i in got] == [id(i) for i in want]


def _configure_scan(address: int) -> None:
    strategies._scan.configure(Instance, rendezvous.hash_fn, rendezvous.name_bytes, rendezvous.encoded, address)


@pytest.fixture(params=["direct xxh3", "through hash_fn"])
def weights(request):
    """The compiled top with the xxhash library called directly (where its address was found) and without."""
    if strategies._scan is None:
        pytest.skip("the compiled scan was not built here")
    address = rendezvous.hash_fn_address()
    if request.param == "direct xxh3" and not address:
        pytest.skip("the xxhash extension does not export XXH3_64bits_withSeed here")
    _configure_scan(address if request.param == "direct xxh3" else 0)
    assert strategies._scan.native_weights() == (request.param == "direct xxh3")
    yield request.param
    _configure_scan(address)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=70, unique=True),
       seed=st.integers(0, 2**64 - 1), other_class=st.booleans())
def test_the_compiled_top_picks_as_rendezvous_does(weights, names, seed, other_class):
    """Names never seen (not yet in rendezvous's cache of encoded names), any text, either kind of object."""
    tied = [(OtherInstance if other_class and n % 2 else Instance)(name, 1000) for n, name in enumerate(names)]
    assert strategies._scan.top(seed, tied) is strategies.top_python(seed, tied)
    assert strategies.top_python(seed, tied).name == rendezvous.top(seed, names)


def test_a_function_that_is_not_xxh3_is_never_called_for_the_weights():
    """configure checks the address it is given against hash_fn's values before using it."""
    import ctypes

    from xxhash import _xxhash

    if strategies._scan is None or not rendezvous.hash_fn_address():
        pytest.skip("the compiled scan was not built here, or xxh3's address was not found")
    try:
        xxh64 = ctypes.cast(ctypes.CDLL(_xxhash.__file__).XXH64, ctypes.c_void_p).value  # same signature
        _configure_scan(xxh64)
        assert not strategies._scan.native_weights()
        tied = [Instance(f"instance-{n}", 1000) for n in range(20)]
        assert strategies._scan.top(77, tied).name == rendezvous.top(77, [i.name for i in tied])
    finally:
        _configure_scan(rendezvous.hash_fn_address())
    assert strategies._scan.native_weights()


def test_the_compiled_scan_raises_as_python_does_on_objects_it_cannot_read():
    """Internal functions, but a wrong argument must raise, not crash the router."""
    if strategies._scan is None:
        pytest.skip("the compiled scan was not built here")
    good = Instance("a", 1000)
    args = (1_000.0, 10, 0.0, 8, 1.0, 4, 0.2, 1.0, 16.0, 4)
    for up in ([good, object()], [object(), good]):
        with pytest.raises(AttributeError):
            strategies._scan.scan(up, {}, *args)
        with pytest.raises(AttributeError):
            strategies.scan_python(up, {}, *args)
    with pytest.raises(TypeError):
        strategies._scan.scan([good], {"a": "not a number"}, *args)
    with pytest.raises(ValueError):
        strategies._scan.scan([], {}, *args)
    with pytest.raises(AttributeError):
        strategies._scan.top(1, [good, 5])
    assert strategies._scan.top(1, []) is None


def _affinity_reference(hash_key, fleet, threshold, model):
    """The rule as the reference states it: the key's whole rendezvous order, its first instance that is up and
    under the threshold (unhealthy_fallback if the preferred one was down), else the least loaded."""
    serving = fleet.serving(model) if model is not None else None
    names = rendezvous.order(hash_key, list(fleet.instances) if serving is None else sorted(serving))
    for pos, name in enumerate(names):
        inst = fleet.instances[name]
        if inst.routable and inst.inflight < threshold:
            preferred_down = not fleet.instances[names[0]].routable
            return inst, ("affinity" if pos == 0 else "unhealthy_fallback" if preferred_down else "overload_spill")
    return strategies._least_loaded(strategies._routable(fleet, model)), "overload_spill"


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(0, 6), st.booleans()), min_size=1, max_size=12),
       st.integers(0, 2**64 - 1), st.integers(1, 6), st.booleans())
def test_affinity_takes_the_first_instance_of_the_whole_order(drawn, key, threshold, by_model):
    """prefix/session: the shortcut (the order's top, when it can take the request) decides as the full order."""
    fleet = Fleet()
    for n, (healthy, draining, inflight, serves) in enumerate(drawn):
        fleet.add(f"i{n}")
        inst = fleet.instances[f"i{n}"]
        inst.healthy, inst.draining, inst.inflight = healthy, draining, inflight
        fleet.set_models(inst.name, frozenset({"m"} if serves else {"other"}))
    model = "m" if by_model else None
    try:
        want = _affinity_reference(key, fleet, threshold, model)
    except strategies.NoInstanceAvailable:
        with pytest.raises(strategies.NoInstanceAvailable):
            strategies._affinity_choice(key, fleet, threshold, model)
        return
    got = strategies._affinity_choice(key, fleet, threshold, model)
    assert (got[0].name, got[1]) == (want[0].name, want[1])
