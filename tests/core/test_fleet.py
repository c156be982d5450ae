"""The fleet's membership questions that the shell's health checks ask of it."""

from warmroute.core.fleet import Fleet


def fleet_of(models: dict[str, frozenset[str] | None]) -> Fleet:
    f = Fleet()
    for name, served in models.items():
        f.add(name).models = served
    return f


def test_sole_server_is_the_last_routable_instance():
    f = fleet_of({"a": None, "b": None})
    assert not f.sole_server("a")
    f.instances["b"].healthy = False
    assert f.sole_server("a") and not f.sole_server("b")  # b is not routable: nothing to keep
    f.instances["a"].draining = True
    assert not f.sole_server("a")


def test_sole_server_counts_only_instances_that_may_serve_its_models():
    f = fleet_of({"a": frozenset({"m", "n"}), "b": frozenset({"m"}), "c": None})
    assert not f.sole_server("a")  # c has no list: it may serve n
    f.instances["c"].healthy = False
    assert f.sole_server("a")  # n: only a
    assert not f.sole_server("b")  # m: a as well
    assert not f.sole_server("missing")
