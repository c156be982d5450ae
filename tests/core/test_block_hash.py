import os
import random

import pytest
from hypothesis import given, settings, strategies as st

from warmroute.core import block_hash
from warmroute.core.block_hash import block_hashes, numpy_block_hashes, seed_of, text_block_hashes

# CI sets this: there the C version must have been built (elsewhere the numpy one is a valid fallback).
native_required = os.environ.get("WARMROUTE_REQUIRE_NATIVE") == "1"
needs_native = pytest.mark.skipif(not block_hash.NATIVE, reason="the C block hash was not built here (no compiler)")
IMPLEMENTATIONS = [numpy_block_hashes] + ([block_hash._blockhash.block_hashes] if block_hash.NATIVE else [])


def test_the_c_version_is_built_where_required():
    assert block_hash.NATIVE or not native_required
    if block_hash.NATIVE:
        assert block_hashes is block_hash._blockhash.block_hashes


def test_the_numpy_fallback_is_used_when_asked_and_agrees():
    import subprocess
    import sys

    code = ("from warmroute.core import block_hash as b; "
            "print(b.NATIVE, b.block_hashes is b.numpy_block_hashes, b.block_hashes(b'warmroute prefix cache ' * 12, 42)[3])")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "WARMROUTE_PURE_PYTHON": "1"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "18156540493002806131"]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda f: f.__module__)
def test_values_are_pinned(impl):
    # Router replicas of different versions, the emulated engine and the simulator must agree on every hash,
    # whichever implementation each one runs.
    assert impl(b"warmroute prefix cache " * 12, 42, 64) == [
        12426701579521969669, 1373643870920367371, 15662953997839085716, 18156540493002806131]


@needs_native
@given(st.binary(max_size=3000), st.sampled_from([8, 16, 64, 72, 128, 256]),
       st.one_of(st.integers(0, 2**64 - 1), st.integers(-2**70, 2**70)))
@settings(max_examples=300)
def test_c_and_numpy_versions_agree(data, block_bytes, seed):
    assert block_hash._blockhash.block_hashes(data, seed, block_bytes) == numpy_block_hashes(data, seed, block_bytes)


@needs_native
def test_c_version_reads_any_buffer_and_rejects_bad_block_sizes():
    c = block_hash._blockhash.block_hashes
    data = bytes(range(256)) * 3
    assert c(bytearray(data), 1, 64) == c(memoryview(data), 1, 64) == numpy_block_hashes(data, 1, 64)
    for bad in (0, -8, 12):
        with pytest.raises(ValueError):
            c(data, 1, bad)
        with pytest.raises(ValueError):
            numpy_block_hashes(data, 1, bad)
    with pytest.raises(TypeError):
        c(12345, 1, 64)


# Texts of every kind: ASCII (read in place by the C version), any code point, lone surrogates (encoded with
# surrogatepass, as routing keys are).
_TEXTS = st.one_of(st.text(st.characters(max_codepoint=127), max_size=2500),
                   st.text(st.characters(blacklist_categories=()), max_size=600))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda f: f.__module__)
@given(_TEXTS, st.sampled_from([8, 64, 72]), st.integers(0, 2**64 - 1))
@settings(max_examples=150)
def test_a_text_hashes_as_its_utf8_bytes(impl, text, block_bytes, seed):
    assert impl(text, seed, block_bytes) == numpy_block_hashes(text.encode("utf-8", "surrogatepass"), seed, block_bytes)


@needs_native
def test_a_lazy_chain_of_a_text_keeps_the_text():
    text = "".join(f"prompt {i} " for i in range(3000))  # made here: nothing else holds it
    ref = numpy_block_hashes(text.encode(), 3, 64)
    chain = block_hash._blockhash.block_hashes(text, 3, 64)
    del text
    import gc
    gc.collect()
    assert chain.computed == 0 and chain[len(ref) - 1] == ref[-1] and chain == ref


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


@needs_native
def test_the_c_chain_reads_as_a_list_of_its_ints():
    """The C version returns a Chain (the hashes as uint64 words, ints made only when read); to Python code it
    behaves as the list numpy_block_hashes returns, and the compiled index reads its words in place."""
    import array
    import pickle

    data = random.Random(4).randbytes(64 * 20)
    chain, ref = block_hash._blockhash.block_hashes(data, 7, 64), numpy_block_hashes(data, 7, 64)
    assert type(chain).__name__ == "Chain" and len(chain) == 20 and bool(chain) and not chain[5:5]
    assert chain == ref and ref == chain and not chain != ref and chain != ref[:-1] and chain == tuple(ref)
    assert [chain[i] for i in range(-20, 20)] == ref[-20:] + ref
    for sl in (slice(3, 9), slice(None, -4), slice(None, None, -3), slice(50, 60)):
        assert chain[sl] == ref[sl]
    assert list(chain) == list(reversed(chain))[::-1] == ref and sorted(chain) == sorted(ref)
    assert chain.tolist() == ref and array.array("Q", chain).tolist() == ref
    assert memoryview(chain).format == "Q" and memoryview(chain).tolist() == ref and memoryview(chain).readonly
    assert pickle.loads(pickle.dumps(chain)) == ref and repr(chain) == f"Chain({ref!r})"
    with pytest.raises(IndexError):
        chain[20]
    with pytest.raises(TypeError):
        chain["1"]
    with pytest.raises(TypeError):
        hash(chain)
    with pytest.raises(TypeError):
        chain[0] = 1


_READS = st.one_of(
    st.tuples(st.just("item"), st.integers(-40, 40)),
    st.tuples(st.just("slice"), st.integers(-40, 40) | st.none(), st.integers(-40, 40) | st.none(),
              st.sampled_from([None, 1, 2, 3, -1, -2, -5])),
    st.tuples(st.sampled_from(["len", "bool", "list", "buffer", "eq", "iter", "pickle"])),
)


@needs_native
@given(st.one_of(st.binary(max_size=2500), _TEXTS), st.sampled_from([8, 16, 64, 72]), st.integers(0, 2**64 - 1),
       st.lists(_READS, max_size=8))
@settings(max_examples=300)
def test_a_lazy_chain_reads_as_the_eager_one_whatever_is_read_first(data, block_bytes, seed, reads):
    """A Chain of bytes or a text computes its hashes when first read, as far as they are read; every read in any order
    gives the numpy reference's values, and `computed` only grows, up to the length."""
    import pickle

    chain, ref = block_hash._blockhash.block_hashes(data, seed, block_bytes), numpy_block_hashes(data, seed, block_bytes)
    assert chain.computed == 0 and len(chain) == len(ref)
    seen = 0
    for op, *args in reads:
        if op == "item":
            if -len(ref) <= args[0] < len(ref):
                assert chain[args[0]] == ref[args[0]]
            else:
                with pytest.raises(IndexError):
                    chain[args[0]]
        elif op == "slice":
            assert chain[slice(*args)] == ref[slice(*args)]
        elif op == "len":
            assert len(chain) == len(ref)
        elif op == "bool":
            assert bool(chain) == bool(ref)
        elif op == "list":
            assert chain.tolist() == ref
        elif op == "buffer":
            assert memoryview(chain).tolist() == ref
        elif op == "eq":
            assert chain == ref and chain == block_hash._blockhash.block_hashes(data, seed, block_bytes)
        elif op == "iter":
            assert list(chain) == ref
        else:
            assert pickle.loads(pickle.dumps(chain)) == ref
        assert seen <= chain.computed <= len(ref)
        seen = chain.computed
    assert chain == ref and chain.computed == len(ref)


@needs_native
def test_a_chain_reads_only_as_far_as_asked_and_not_from_mutable_buffers():
    data = random.Random(5).randbytes(64 * 500)
    chain = block_hash._blockhash.block_hashes(data, 1, 64)
    assert chain.computed == 0 and len(chain) == 500 and chain  # length and truth need no hashing
    first = chain[0]
    assert chain.computed == 1
    assert chain[:10] == numpy_block_hashes(data[:640], 1, 64) and chain.computed == 10
    assert chain[99] == numpy_block_hashes(data, 1, 64)[99] and chain.computed == 100
    assert chain[0] == first
    # A bytearray may change after the call: its chain is computed at once, from the bytes as they were.
    buf = bytearray(data[:64 * 4])
    eager = block_hash._blockhash.block_hashes(buf, 1, 64)
    assert eager.computed == 4
    buf[:64] = bytes(64)
    assert eager == numpy_block_hashes(data[:64 * 4], 1, 64)
