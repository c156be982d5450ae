"""The decision's compiled primitives (core/_scan.c, stages/compiled.py) agree with their Python twins: the
rendezvous top of a tie, the rendezvous seed of a prompt, the routable filter. No policy is compiled: every
strategy runs its stages in Python."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from warmroute.core import rendezvous
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.routing_key import RoutingKey
from warmroute.core.stages import compiled
from warmroute.core.stages.affinity import affinity_choice
from warmroute.core.stages.load_guard import least_loaded
from warmroute.core.stages.routable import routable
from warmroute.core.strategies import NoInstanceAvailable


def test_the_compiled_primitives_are_built_where_required():
    assert compiled._scan is not None or os.environ.get("WARMROUTE_REQUIRE_NATIVE") != "1"


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
