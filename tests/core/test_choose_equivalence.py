"""cache_aware's pipeline runs compiled where core/_scan.c was built (stages/compiled.py): these properties check
that the compiled path decides exactly as the pipeline run stage by stage (the readable rule, and the production
code where no C compiler was found) on random fleets, and that the compiled helpers (top, routable) agree with
their Python versions.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from warmroute.core import rendezvous
from warmroute.core.engine_load import EngineLoad
from warmroute.core.fleet import RECENT_WINDOW, Fleet, FleetSettings, Instance
from warmroute.core.pipeline import Request
from warmroute.core.routing_key import RoutingKey, key_for_json
from warmroute.core.stages import Handles, compiled
from warmroute.core.stages.affinity import affinity_choice
from warmroute.core.stages.load_guard import least_loaded
from warmroute.core.stages.routable import routable
from warmroute.core.strategies import CacheAwareSettings, NoInstanceAvailable, StrategySettings, make_strategy

needs_c = pytest.mark.skipif(compiled._scan is None, reason="the compiled scan was not built here")


def both_ways(s: StrategySettings, depths: dict[str, int] | None = None):
    """The same strategy twice: compiled, and stage by stage; depths given (as the simulator's oracle gives
    them) or from the fleet's index."""
    handles = Handles(depths=lambda blocks, fleet: dict(depths)) if depths is not None else Handles()
    fast, slow = make_strategy("cache_aware", s, handles=handles), make_strategy("cache_aware", s, handles=handles)
    slow.pipeline.fast = None
    assert fast.pipeline.fast is not None
    return fast, slow


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
    "ramp": st.sampled_from([None, None, None, 0.0, 5.0, 40.0]),  # seconds into a slow-start ramp
})
strategy_settings = st.builds(
    StrategySettings,
    prefix_length=st.sampled_from([1024, 4096]),
    concurrency_threshold=st.sampled_from([1, 2, 4, 32, 1024]),
    cache_aware=st.builds(
        CacheAwareSettings,
        balance_factor=st.sampled_from([0.0, 0.25, 1.0, 10.0]),
        balance_slack=st.sampled_from([0, 2, 4]),
        cold_to_least_loaded=st.booleans(),
        miss_weight=st.sampled_from([0.0, 1.0, 2.0, 2, 3.5, 16.0]),
        shared_miss_weight=st.sampled_from([0.0, 1.0, 2.0]),
        sticky_kv_limit=st.sampled_from([0.0, 1.75, 1000.0]),
        hot_balance_factor=st.sampled_from([0.0, 0.2, 1.0]),
        hot_balance_slack=st.sampled_from([0.0, 2.0]),
        slow_start_window=st.sampled_from([0.0, 30.0]),
    ),
)
block_sizes = st.sampled_from([64, 128])


def make_fleet(drawn: list[dict], mean_uncached: float, block_bytes: int = 64) -> tuple[Fleet, dict[str, int]]:
    f = Fleet(FleetSettings(block_bytes=block_bytes))
    depths = {}
    for n, d in enumerate(drawn):
        inst = f.add(f"i{n}", d["kv"], d["rate"])
        inst.inflight, inst.queued_prefill_tokens = d["inflight"], d["queued"]
        inst.healthy, inst.draining, inst.engine = d["healthy"], d["draining"], d["engine"]
        inst.recent = d["recent"]
        inst.inflight_prompt_tokens = d["prompt_tokens"] if d["inflight"] else 0
        if d.get("ramp") is not None:
            f.ramps[inst.name] = f.now - d["ramp"]
        if d["depth"]:
            depths[inst.name] = d["depth"]
    f.mean_uncached_tokens = mean_uncached
    return f, depths


def outcome(strategy, key, fleet):
    try:
        return strategy.choose(key, fleet)
    except NoInstanceAvailable:
        return "no instance"


def test_the_compiled_scan_is_built_where_required():
    assert compiled._scan is not None or os.environ.get("WARMROUTE_REQUIRE_NATIVE") != "1"
    assert make_strategy("cache_aware").pipeline.fast is not None or compiled._scan is None


def test_pipelines_of_other_stages_run_stage_by_stage():
    off = make_strategy("cache_aware", StrategySettings(cache_aware=CacheAwareSettings(cold_to_least_loaded=False)))
    assert [p.name for p in off.pipeline.pickers] == ["tie_slack", "rendezvous"]
    assert (off.pipeline.fast is not None) == (compiled._scan is not None)  # least_slack inf: compiled too
    for name in ("prefix", "session", "least_loaded", "round_robin", "random"):
        assert make_strategy(name).pipeline.fast is None


def _popular(strategies_, prefix, hot: int, n: int) -> None:
    for s in strategies_:  # `hot` requests for it out of 3
        for k in range(3):
            s.popularity.add(prefix if k < hot else None, RECENT_WINDOW * n)


@needs_c
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(instances, min_size=1, max_size=12), strategy_settings, block_sizes,
       st.text(min_size=0, max_size=3000), st.sampled_from([0.0, 500.0, 4321.5]),
       st.dictionaries(st.sampled_from(["gone", "i99"]), st.integers(1, 50), max_size=2),
       st.integers(0, 3), st.one_of(st.sampled_from([1.0, 0.05]), st.floats(0.001, 100)))
def test_compiled_choose_decides_as_the_pipeline(drawn, s, block_bytes, prompt, mean_uncached, stray_depths, hot,
                                                 unit):
    f, depths = make_fleet(drawn, mean_uncached, block_bytes)
    f.recent_unit.value = unit
    depths.update(stray_depths)  # names the fleet does not know: ignored by both
    fast, slow = both_ways(s, depths)
    k = key_for_json("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": prompt}]})
    blocks = k.blocks(block_bytes)
    if depths and blocks:  # make its prefix popular (or not)
        _popular((fast, slow), blocks[min(max(depths.values()), len(blocks)) - 1], hot, len(drawn))
    assert outcome(fast, k, f) == outcome(slow, k, f)


@needs_c
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(instances, min_size=2, max_size=12), strategy_settings, st.integers(1, 600),
       st.text(min_size=300, max_size=3000), st.one_of(st.sampled_from([1.0, 0.05]), st.floats(0.001, 100)))
def test_compiled_choose_for_a_hot_prefix_decides_as_the_pipeline(drawn, s, depth, prompt, unit):
    """A prefix on every recent request: the guard on recent requests applies."""
    f, depths = make_fleet(drawn, 500.0)
    f.recent_unit.value = unit
    depths["i0"] = depth
    fast, slow = both_ways(s, depths)
    k = key_for_json("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": prompt}]})
    blocks = k.blocks()
    _popular((fast, slow), blocks[min(max(depths.values()), len(blocks)) - 1], 3, len(drawn))
    assert outcome(fast, k, f) == outcome(slow, k, f)


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.integers(0, 2**64 - 1))
def test_idle_fleet_all_tied_matches_the_pipeline(n, seed):
    """A cold prompt on an idle fleet: every instance ties and rendezvous picks among all of them."""
    f = Fleet(FleetSettings())
    for j in range(n):
        f.add(f"instance-{j}", 10**8)
    fast, slow = both_ways(StrategySettings())
    k = key_for_json("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": f"{seed}"}]})
    assert fast.choose(k, f) == slow.choose(k, f)


@needs_c
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 40), st.integers(0, 3)), max_size=40),
       st.integers(0, 3), st.integers(1, 40))
def test_compiled_choose_with_the_real_index_matches_the_pipeline(records, prompt_id, prompt_blocks):
    """Depths from the prefix index itself (chains sharing prefixes, per-instance caps with eviction)."""
    f = Fleet(FleetSettings(index_max_bytes=400 * 8 * 60))  # 60 entries per instance: evictions happen
    for j in range(8):
        f.add(f"i{j}", 10**8)
    texts = [f"shared system prompt {p} " * 200 for p in range(4)]
    fast, slow = both_ways(StrategySettings())
    for inst, n_blocks, p in records:
        f.index.record(f"i{inst}", key_for_json("/v1/completions", {"prompt": texts[p]}).blocks()[:n_blocks])
        f.instances[f"i{inst}"].inflight += 1
    k = key_for_json("/v1/completions", {"prompt": texts[prompt_id][:64 * prompt_blocks]})
    depths = f.index.match_depths(k.blocks())
    for _ in range(prompt_id if depths else 0):  # some prompts are hot; the busy instances' recent counts high
        for s in (fast, slow):
            s.popularity.add(k.blocks()[max(depths.values()) - 1], 8)
    for j, (inst, _, _) in enumerate(records):
        f.instances[f"i{inst}"].recent += j
    assert fast.choose(k, f) == slow.choose(k, f)


class Name(str):
    """A str subclass: a dict finds it by value, and so must the compiled scan."""


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.lists(instances, min_size=1, max_size=12), st.sampled_from(["same", "copy", "subclass"]))
def test_the_compiled_scan_finds_a_holders_miss_weight_by_its_names_value(drawn, names):
    """Depths keyed by the instances' own name objects, by equal copies of them, or by a str subclass (a depth
    source may give any of these): up to 8 holders the scan compares names itself, past 8 it asks the dict."""
    f, depths = make_fleet(drawn, 500.0)
    as_key = {"same": lambda n: n, "copy": lambda n: "".join(list(n)), "subclass": Name}[names]
    depths = {as_key(n): d for n, d in depths.items()}
    assert names == "same" or not any(n in f.instances and f.instances[n].name is n for n in depths)
    fast, slow = both_ways(StrategySettings(), depths)
    k = key_for_json("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "p " * 400}]})
    assert outcome(fast, k, f) == outcome(slow, k, f)


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


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.lists(instances, min_size=1, max_size=12), st.sampled_from([0.0, 4321.5]), st.integers(0, 3))
def test_the_compiled_scan_reads_other_objects_as_python_does(drawn, mean, hot):
    f, depths = make_fleet(drawn, mean)
    for n, name in enumerate(list(f.instances)):
        if n % 2:  # every other instance of a subclass, whose fields the compiled scan reads with getattr
            old = f.instances[name]
            other = f.instances[name] = OtherInstance(name, old.kv_capacity_tokens, old.prefill_tokens_per_s)
            for field in ("healthy", "draining", "inflight", "queued_prefill_tokens", "engine", "recent",
                          "inflight_prompt_tokens"):
                setattr(other, field, getattr(old, field))
    fast, slow = both_ways(StrategySettings(), depths)
    k = key_for_json("/v1/completions", {"prompt": "a shared prefix " * 50})
    if depths:
        _popular((fast, slow), k.blocks()[min(max(depths.values()), len(k.blocks())) - 1], hot, len(drawn))
    assert outcome(fast, k, f) == outcome(slow, k, f)


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
    compiled._scan.configure(Instance, rendezvous.hash_fn, rendezvous.name_bytes, rendezvous.encoded, address)


@pytest.fixture(params=["direct xxh3", "through hash_fn"])
def weights(request):
    """The compiled top with the xxhash library called directly (where its address was found) and without."""
    if compiled._scan is None:
        pytest.skip("the compiled scan was not built here")
    address = rendezvous.hash_fn_address()
    if request.param == "direct xxh3" and not address:
        pytest.skip("the xxhash extension does not export XXH3_64bits_withSeed here")
    _configure_scan(address if request.param == "direct xxh3" else 0)
    assert compiled._scan.native_weights() == (request.param == "direct xxh3")
    yield request.param
    _configure_scan(address)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=70, unique=True),
       seed=st.integers(0, 2**64 - 1), other_class=st.booleans())
def test_the_compiled_top_picks_as_rendezvous_does(weights, names, seed, other_class):
    """Names never seen (not yet in rendezvous's cache of encoded names), any text, either kind of object."""
    tied = [(OtherInstance if other_class and n % 2 else Instance)(name, 1000) for n, name in enumerate(names)]
    assert compiled._scan.top(seed, tied) is compiled.top_python(seed, tied)
    assert compiled.top_python(seed, tied).name == rendezvous.top(seed, names)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(alphabet=st.characters(max_codepoint=127), max_size=300), st.text(max_size=300),
                      st.binary(max_size=300)),
       length=st.one_of(st.integers(-3, 320), st.sampled_from([1024, 4096])),
       seed=st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([-1, 2**64])))
def test_the_compiled_prefix_hash_is_the_keys(weights, text, length, seed):
    """An ASCII text hashed in place (directly by xxh3, where configured so) gives what the key's own prefix_hash
    gives; any other text, bytes, length or seed is left to it (and gives what it gives, or raises as it does)."""
    key = RoutingKey(seed, text, text)
    try:
        want = key.prefix_hash(length)
    except (OverflowError, ValueError, TypeError) as e:
        with pytest.raises(type(e)):
            compiled.prefix_hash(key, length)
        return
    assert compiled.prefix_hash(key, length) == want
    done_in_place = compiled._scan.text_hash(text, length, seed) is not None
    assert done_in_place == (weights == "direct xxh3" and isinstance(text, str) and text.isascii() and length >= 0
                             and 0 <= seed < 2**64)


def test_a_function_that_is_not_xxh3_is_never_called_for_the_weights():
    """configure checks the address it is given against hash_fn's values before using it."""
    import ctypes

    from xxhash import _xxhash

    if compiled._scan is None or not rendezvous.hash_fn_address():
        pytest.skip("the compiled scan was not built here, or xxh3's address was not found")
    try:
        xxh64 = ctypes.cast(ctypes.CDLL(_xxhash.__file__).XXH64, ctypes.c_void_p).value  # same signature
        _configure_scan(xxh64)
        assert not compiled._scan.native_weights()
        tied = [Instance(f"instance-{n}", 1000) for n in range(20)]
        assert compiled._scan.top(77, tied).name == rendezvous.top(77, [i.name for i in tied])
    finally:
        _configure_scan(rendezvous.hash_fn_address())
    assert compiled._scan.native_weights()


@needs_c
def test_the_compiled_scan_raises_as_python_does_on_objects_it_cannot_read():
    """Internal functions, but a wrong argument must raise, not crash the router."""
    f = Fleet(FleetSettings())
    good = f.add("a", 1000)
    fast, slow = both_ways(StrategySettings())
    k = key_for_json("/v1/completions", {"prompt": "x" * 200})
    for up in ([good, object()], [object(), good]):
        for s in (fast, slow):
            with pytest.raises(AttributeError):
                s.pipeline.run(Request(k, f, up))
    params = compiled.ScanParams(8, 1.0, 4, False, 0.2, 1.0, {"a": "not a number"}, 1_000.0, 10, 0.0, 16.0, 4)
    with pytest.raises(TypeError):
        compiled._scan.scan([good], params)
    with pytest.raises(ValueError):
        compiled._scan.scan([], params._replace(miss={}))
    with pytest.raises(TypeError):
        compiled._scan.scan([good], (1, 2, 3))  # not ScanParams's fields
    with pytest.raises(AttributeError):
        compiled._scan.top(1, [good, 5])
    assert compiled._scan.top(1, []) is None


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
    return least_loaded(routable(fleet, model)), "overload_spill"


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
    except NoInstanceAvailable:
        with pytest.raises(NoInstanceAvailable):
            affinity_choice(key, fleet, threshold, model, routable(fleet, model))
        return
    got = affinity_choice(key, fleet, threshold, model, routable(fleet, model))
    assert (got[0].name, got[1]) == (want[0].name, want[1])
