import pytest
from hypothesis import given, strategies as st

from warmroute.core.routing_key import KeyError_, key_for_json, key_for_raw

CHAT = "/v1/chat/completions"


def chat(messages, **kw):
    return key_for_json(CHAT, {"model": "m", "messages": messages, **kw})


def test_every_message_role_and_text_in_order():
    k = chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert k.data == b"<|system|>\nS\n<|user|>\nU\n"


def test_multimodal_text_parts_and_tools_count():
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]
    k = chat([{"role": "user", "content": parts}])
    assert b"a" in k.data and b"b" in k.data and b"image_url" in k.data
    with_tools = chat([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "f"}}])
    assert with_tools.data.startswith(b"<|tools|>") and with_tools.data != chat([{"role": "user", "content": "hi"}]).data


def test_model_and_cache_salt_seed_the_hash():
    msgs = [{"role": "user", "content": "x" * 300}]
    a = key_for_json(CHAT, {"model": "a", "messages": msgs})
    b = key_for_json(CHAT, {"model": "b", "messages": msgs})
    salted = key_for_json(CHAT, {"model": "a", "messages": msgs, "cache_salt": "tenant-1"})
    assert a.data == b.data and a.blocks()[0] != b.blocks()[0] and a.blocks()[0] != salted.blocks()[0]


def test_completion_prompt_forms():
    assert key_for_json("/v1/completions", {"prompt": "hello"}).data == b"hello"
    assert key_for_json("/v1/completions", {"prompt": ["a", "b"]}).data == b"a\nb"
    ids = key_for_json("/v1/completions", {"prompt": list(range(32))})
    assert len(ids.data) == 128 and ids.tokens == 32 and len(ids.blocks()) == 2


def test_prefix_length_counts_characters_for_chat_and_bytes_for_invocations():
    a = chat([{"role": "user", "content": "é" * 2000 + "A"}])
    b = chat([{"role": "user", "content": "é" * 2000 + "B"}])
    assert a.prefix_hash(1024) == b.prefix_hash(1024) and a.prefix_hash(4000) != b.prefix_hash(4000)
    r1, r2 = key_for_raw(b"x" * 1024 + b"1"), key_for_raw(b"x" * 1024 + b"2")
    assert r1.prefix_hash(1024) == r2.prefix_hash(1024) and r1.prefix_hash(1025) != r2.prefix_hash(1025)


def test_session_from_user_field():
    assert chat([{"role": "user", "content": "x"}], user="u1").session == "u1"


@pytest.mark.parametrize("body, needle", [
    ([1, 2], "JSON object"),
    ({"model": "m"}, "messages"),
    ({"messages": "hi"}, "list"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [7]}, r"messages\[0\]"),
])
def test_bad_bodies_name_the_problem(body, needle):
    with pytest.raises(KeyError_, match=needle):
        key_for_json(CHAT, body)


def test_bad_prompt_forms():
    for prompt in (5, [], [1, "a"], [-1], [2**40]):
        with pytest.raises(KeyError_):
            key_for_json("/v1/completions", {"prompt": prompt})


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=20))
def test_any_json_either_keys_or_raises_the_documented_error(body):
    for path in (CHAT, "/v1/completions", "/v1/embeddings", "/v1/responses"):
        try:
            k = key_for_json(path, body)
        except KeyError_:
            continue
        assert isinstance(k.data, bytes)


@given(st.text(st.characters(blacklist_categories=()), max_size=400), st.sampled_from([CHAT, "/v1/completions"]))
def test_a_text_key_is_its_utf8_bytes_for_length_and_hashes(text, path):
    """A rendered text is kept as text (hashed in place where ASCII): its length in tokens and its block hashes
    are those of its UTF-8 bytes (lone surrogates passed through)."""
    from warmroute.core.block_hash import numpy_block_hashes

    body = {"model": "m", "messages": [{"role": "user", "content": text * 3}]} if path == CHAT else {"prompt": text * 3}
    k = key_for_json(path, body)
    raw = k.data
    assert isinstance(raw, bytes) and raw == k.source.encode("utf-8", "surrogatepass")
    assert k.tokens == max(1, len(raw) // 4)
    assert list(k.blocks()) == numpy_block_hashes(raw, k.seed, 64)
