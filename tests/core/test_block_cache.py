from warmroute.core.block_cache import BlockCache


def test_match_counts_leading_cached_blocks():
    c = BlockCache(10)
    c.insert([1, 2, 3])
    assert c.match([1, 2, 3, 4]) == 3
    assert c.match([1, 9, 3]) == 1
    assert c.match([9, 1]) == 0


def test_lru_evicts_least_recent_chain_tail_first():
    c = BlockCache(4)
    c.insert([1, 2])
    c.insert([3, 4])
    c.insert([1, 2])  # refresh chain 1-2: now 3-4 is older
    c.insert([5])  # evicts 4 (tail of the older chain) before 3
    assert 4 not in c and 3 in c
    assert c.lru_order() == [3, 2, 1, 5]
    c.insert([6])
    assert 3 not in c and c.match([1, 2]) == 2


def test_eviction_keeps_prefixes_whole():
    c = BlockCache(3)
    c.insert([1, 2, 3])
    c.insert([9])
    assert c.match([1, 2, 3]) == 2  # the tail went, the head stayed


def test_pinned_blocks_are_never_evicted():
    c = BlockCache(3)
    assert c.pin([1, 2])
    c.insert([7])
    c.insert([8])  # only 7 was evictable
    assert 1 in c and 2 in c and 8 in c and 7 not in c
    assert not c.pin([4, 5])  # would need to evict a pinned block
    assert 1 in c and 2 in c  # a failed pin changes nothing
    c.unpin([1, 2])
    assert c.pin([4, 5])


def test_unpin_makes_blocks_evictable_tail_first():
    c = BlockCache(3)
    c.pin([1, 2, 3])
    c.unpin([1, 2, 3])
    assert c.lru_order() == [3, 2, 1]


def test_reserved_blocks_take_capacity():
    c = BlockCache(4)
    c.insert([1, 2, 3])
    assert c.pin([9], extra_blocks=2)  # needs 3 slots: evicts 3 and 2
    assert c.used_blocks == 4 and c.match([1, 2, 3]) == 1
    c.unpin([9], extra_blocks=2)
    assert c.reserved == 0


def test_evict_callback_and_remove():
    gone = []
    c = BlockCache(2, on_evict=gone.append)
    c.insert([1, 2])
    c.insert([3])
    assert gone == [2]
    assert c.remove([1, 42]) == 1
    assert gone == [2, 1]
