import random
import tracemalloc

from warmroute.core.block_hash import block_hashes
from warmroute.core.prefix_index import BYTES_PER_ENTRY, PrefixIndex


def chain(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return block_hashes(bytes(rng.getrandbits(8) for _ in range(64 * n)))


def test_match_depths_per_instance():
    idx = PrefixIndex(10_000)
    for name in ("a", "b", "c"):
        idx.add_instance(name, 1000)
    blocks = chain(40, 1)
    idx.record("a", blocks[:40])
    idx.record("b", blocks[:13])
    idx.record("c", chain(5, 2))
    assert idx.match_depths(blocks) == {"a": 40, "b": 13}
    assert idx.match_depths(blocks[:10]) == {"a": 10, "b": 10}
    assert idx.match_depths(chain(3, 99)) == {}


def test_match_depths_agree_with_a_linear_scan():
    rng = random.Random(3)
    idx = PrefixIndex(100_000)
    names = [f"i{j}" for j in range(6)]
    for n in names:
        idx.add_instance(n, 300)  # small: evictions happen
    base = chain(120, 5)
    for _ in range(400):
        n = rng.choice(names)
        idx.record(n, base[: rng.randint(1, 120)] if rng.random() < 0.7 else chain(rng.randint(1, 30), rng.random()))
    for depth in (1, 7, 64, 120):
        q = base[:depth]
        expected = {}
        for n in names:
            d = 0
            while d < len(q) and idx.holds(n, q[d]):
                d += 1
            if d:
                expected[n] = d
        assert idx.match_depths(q) == expected


def test_each_instance_is_capped_and_evicts_lru():
    idx = PrefixIndex(10_000)
    idx.add_instance("a", 100)
    old, new = chain(60, 1), chain(60, 2)
    idx.record("a", old)
    idx.record("a", new)
    assert idx.entries("a") == 100
    assert idx.match_depths(new) == {"a": 60}
    assert idx.match_depths(old) == {"a": 40}  # the old chain lost its tail, never its head


def test_total_entries_never_exceed_the_cap():
    idx = PrefixIndex(5_000)
    for j in range(4):
        idx.add_instance(f"i{j}", 10**9)  # configured capacity far above the memory cap
    rng = random.Random(0)
    for p in range(3000):
        idx.record(f"i{p % 4}", block_hashes(rng.randbytes(64 * 8), p))
        assert idx.entries() <= 5_000
    first = block_hashes(random.Random(0).randbytes(64 * 8), 0)
    assert idx.match_depths(first) == {}  # the least recently used went first
    idx.add_instance("i4", 10**9)  # a new instance shrinks everyone's share
    assert idx.entries() <= 5_000 and all(idx.entries(f"i{j}") <= 1000 for j in range(5))


def test_remove_and_forget():
    idx = PrefixIndex(1000)
    idx.add_instance("a", 100)
    idx.add_instance("b", 100)
    c = chain(10, 1)
    idx.record("a", c)
    idx.record("b", c)
    assert idx.forget("a", c[4:]) == 6
    assert idx.match_depths(c) == {"a": 4, "b": 10}
    idx.remove_instance("b")
    assert idx.match_depths(c) == {"a": 4}
    idx.add_instance("c", 100)  # reuses b's bit; must not inherit b's blocks
    assert idx.match_depths(c) == {"a": 4}


def test_memory_per_entry_estimate():
    """BYTES_PER_ENTRY (used to turn the byte cap into an entry cap) must not understate real use."""
    idx = PrefixIndex(10**7)
    for j in range(4):
        idx.add_instance(f"i{j}", 10**7)
    rng = random.Random(1)
    chains = [block_hashes(rng.randbytes(64 * 50), p) for p in range(2000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for p, c in enumerate(chains):
        idx.record(f"i{p % 4}", c)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_entry = used / idx.entries()
    assert per_entry <= BYTES_PER_ENTRY, per_entry
    assert per_entry >= BYTES_PER_ENTRY / 3, per_entry  # and is not wildly pessimistic
