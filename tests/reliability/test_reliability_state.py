"""Bounded state: one million distinct prompts through the router's prefix index with a 16 MiB cap.

The index only ever sees chained block hashes, so the prompts here are their hash chains (two 64-byte blocks
each, distinct per prompt, from a 64-bit mixing function instead of xxhash over generated text: hashing a
million strings would dominate the run on two cores). The assertions: the entry count never exceeds the cap
derived from the byte budget, the entries kept are exactly the most recently used ones, and the memory
tracemalloc sees for the whole run stays under the cap.
"""

from __future__ import annotations

import time
import tracemalloc

import pytest

from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.prefix_index import BYTES_PER_ENTRY

CAP = 16 * 1024 * 1024
PROMPTS = 1_000_000
INSTANCES = ("a", "b", "c", "d")
TRACED = 300_000  # prompts run under tracemalloc
_M = (1 << 64) - 1


def _chain(i: int) -> list[int]:
    h = (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _M
    return [h, (h ^ (h >> 31)) * 0xBF58476D1CE4E5B9 & _M]


@pytest.mark.slow
def test_a_million_prompts_stay_under_the_cap_and_evict_lru():
    fleet = Fleet(FleetSettings(index_max_bytes=CAP))
    for name in INSTANCES:
        fleet.add(name)
    idx = fleet.index
    max_entries = CAP // BYTES_PER_ENTRY
    assert idx.max_entries == max_entries

    record = idx.record  # what Fleet.dispatched does with a request's blocks
    tracemalloc.start()  # traced while the index fills and then turns over 8x; untraced (3x faster) after
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    start = time.perf_counter()
    most = 0
    for i in range(PROMPTS):
        record(INSTANCES[i % len(INSTANCES)], _chain(i))
        if i % 1000 == 0:
            most = max(most, idx.entries())
            if i == TRACED:
                current, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
    took = time.perf_counter() - start
    used_peak = peak - base

    assert most <= max_entries and idx.entries() <= max_entries
    # Each instance's share is full, and holds exactly its most recent prompts: the LRU ones went first.
    share = max_entries // len(INSTANCES)
    for j, name in enumerate(INSTANCES):
        assert idx.entries(name) == share
        mine = list(range(j, PROMPTS, len(INSTANCES)))
        kept = share // 2  # whole two-block prompts (an odd share keeps the head block of one more)
        newest, evicted = mine[-kept:], mine[:-kept]
        assert all(idx.holds(name, b) for i in newest[:: max(1, kept // 500)] for b in _chain(i))
        assert all(idx.holds(name, b) for b in _chain(newest[0]))  # the oldest survivor
        assert not idx.holds(name, _chain(evicted[-1])[1])  # the newest evicted (its tail block goes first)
        assert idx.holds(name, _chain(evicted[-1])[0]) == bool(share % 2)
        assert not any(idx.holds(name, b) for b in _chain(evicted[-2]))
        assert not any(idx.holds(name, b) for i in evicted[:: max(1, len(evicted) // 500)] for b in _chain(i))
    assert used_peak <= CAP, used_peak
    print(f"\n{PROMPTS:,} prompts in {took:.1f}s (first {TRACED:,} traced): entries {idx.entries():,} <= cap "
          f"{max_entries:,}; tracemalloc peak {used_peak / 2**20:.2f} MiB vs cap {CAP / 2**20:.0f} MiB; "
          f"estimated {idx.estimated_bytes() / 2**20:.2f} MiB")
