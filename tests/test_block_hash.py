import random

from hypothesis import given, settings, strategies as st

from warmroute.core.block_hash import block_hashes, seed_of, text_block_hashes


def test_only_full_blocks_are_hashed():
    assert block_hashes(b"x" * 63) == []
    assert len(block_hashes(b"x" * 64)) == 1
    assert len(block_hashes(b"x" * 200)) == 3


@given(st.binary(min_size=0, max_size=2000), st.binary(min_size=0, max_size=2000))
@settings(max_examples=200)
def test_shared_leading_blocks_give_equal_leading_hashes(a, b):
    ha, hb = block_hashes(a, 5), block_hashes(b, 5)
    for k in range(min(len(ha), len(hb))):
        same_prefix = a[: (k + 1) * 64] == b[: (k + 1) * 64]
        assert (ha[k] == hb[k]) == same_prefix


def test_chain_depends_on_every_earlier_block():
    rng = random.Random(1)
    base = bytes(rng.getrandbits(8) for _ in range(64 * 20))
    h = block_hashes(base)
    for pos in (0, 63, 64 * 7 + 5, 64 * 19):
        changed = bytearray(base)
        changed[pos] ^= 0x80  # a top-bit flip: the weak spot of a purely linear hash
        h2 = block_hashes(bytes(changed))
        k = pos // 64
        assert h2[:k] == h[:k] and all(x != y for x, y in zip(h2[k:], h[k:]))


def test_seed_separates_models():
    text = "same prompt " * 50
    assert text_block_hashes(text, seed_of("model-a")) != text_block_hashes(text, seed_of("model-b"))
    assert text_block_hashes(text, seed_of("m", "salt1"))[0] != text_block_hashes(text, seed_of("m", "salt2"))[0]


def test_deterministic_and_collision_free_on_many_blocks():
    rng = random.Random(7)
    data = bytes(rng.getrandbits(8) for _ in range(64 * 5000))
    h = block_hashes(data, 3)
    assert h == block_hashes(data, 3)
    assert len(set(h)) == len(h)
    assert all(0 <= x < 2**64 for x in h)
