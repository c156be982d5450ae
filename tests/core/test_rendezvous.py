import random

from warmroute.core import rendezvous


def _moved_fraction(before: list[str], after: list[str], keys: list[int]) -> float:
    return sum(rendezvous.top(k, before) != rendezvous.top(k, after) for k in keys) / len(keys)


def test_scale_up_moves_about_one_over_n_plus_one():
    keys = [random.Random(i).getrandbits(64) for i in range(20000)]
    for n in (3, 7, 15):
        names = [f"i{j}" for j in range(n)]
        moved = _moved_fraction(names, names + ["new"], keys)
        assert abs(moved - 1 / (n + 1)) <= 0.1 / (n + 1), (n, moved)


def test_scale_down_moves_only_the_removed_instances_keys():
    keys = [random.Random(i).getrandbits(64) for i in range(20000)]
    names = [f"i{j}" for j in range(8)]
    held = sum(rendezvous.top(k, names) == "i3" for k in keys) / len(keys)
    moved = _moved_fraction(names, [n for n in names if n != "i3"], keys)
    assert moved == held
    assert abs(moved - 1 / 8) <= 0.1 / 8


def test_order_is_a_stable_permutation():
    names = [f"i{j}" for j in range(10)]
    o = rendezvous.order(12345, names)
    assert sorted(o) == sorted(names) and o[0] == rendezvous.top(12345, names)
    assert o == rendezvous.order(12345, list(reversed(names)))
