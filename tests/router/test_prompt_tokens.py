"""Precise mode's tokenizer: the chat template rendered as vLLM does, cut at added tokens without changing a
single token id, cached, and clear errors for what cannot be read."""

from __future__ import annotations

import random
import struct

import pytest

from warmroute.core.routing_key import KeyError_
from tokenizer_helpers import WORDS, write_model_dir
from warmroute.router.prompt_tokens import PromptTokenizer, TokenizerError

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    write_model_dir(d)
    return d


def ids(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def conversation(turns: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    roles = ["system"] + ["user", "assistant"] * turns
    return [{"role": r, "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
             + rng.choice(["", " ", "\n", "!?", " 12,3"])} for r in roles[: turns + 1]]


def test_pieces_tokenize_exactly_as_the_whole_text(model_dir):
    tok = PromptTokenizer(model_dir)
    assert tok._split is not None  # ChatML's markers cut the text
    for seed in range(20):
        messages = conversation(8, seed)
        text = tok.render(messages, None)
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
        whole = tok.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids(tok.chat(messages)) == whole
        assert ids(tok.chat(messages)) == whole  # from the cache


def test_a_longer_conversation_extends_the_shorter_ones_tokens(model_dir):
    tok = PromptTokenizer(model_dir)
    messages = conversation(10)
    short = tok.chat(messages[:5], add_generation_prompt=False)
    long = tok.chat(messages)
    assert long.startswith(short)


def test_list_contents_and_completions(model_dir):
    tok = PromptTokenizer(model_dir)
    parts = [{"role": "user", "content": [{"type": "text", "text": "the cache"}, {"type": "image_url"},
                                          {"type": "text", "text": "holds keys"}]}]
    plain = [{"role": "user", "content": "the cache\nholds keys"}]
    assert tok.chat(parts) == tok.chat(plain)
    assert ids(tok.tokens_for(False, {"prompt": [5, 6, 7]})) == [5, 6, 7]
    text = tok.tokens_for(False, {"prompt": "the cache holds"})
    assert ids(text) == tok.tokenizer.encode("the cache holds").ids
    assert tok.tokens_for(False, {"prompt": ["the cache holds", "x"]}) == text


@pytest.mark.parametrize("body", [{"messages": "hi"}, {"messages": [1]}, {}])
def test_bad_chat_bodies_are_400s(model_dir, body):
    with pytest.raises(KeyError_):
        PromptTokenizer(model_dir).tokens_for(True, body)


def test_bad_prompts_are_400s(model_dir):
    tok = PromptTokenizer(model_dir)
    for prompt in (None, 3, [1.5], [2**33]):
        with pytest.raises(KeyError_):
            tok.tokens_for(False, {"prompt": prompt})


def test_missing_tokenizer_or_template_is_a_clear_error(tmp_path, model_dir):
    with pytest.raises(TokenizerError, match="cannot load a tokenizer"):
        PromptTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    tok = PromptTokenizer(tmp_path)  # no tokenizer_config.json: completions only
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.chat([{"role": "user", "content": "x"}])


def test_the_cache_is_bounded(model_dir):
    tok = PromptTokenizer(model_dir, cache_bytes=2000)
    for seed in range(50):
        tok.chat(conversation(4, seed))
    assert tok._cache_bytes <= 2000


async def test_long_new_text_is_tokenized_ahead_off_the_loop(model_dir, monkeypatch):
    import asyncio

    tok = PromptTokenizer(model_dir)
    threads = []
    real = asyncio.to_thread
    monkeypatch.setattr(asyncio, "to_thread", lambda fn, *a: threads.append(fn) or real(fn, *a))
    long_doc = " ".join(random.Random(3).choice(WORDS) for _ in range(5000))  # > OFFLOAD_CHARS
    body = {"messages": [{"role": "system", "content": long_doc}, {"role": "user", "content": "and?"}]}
    await tok.warm(True, body)
    assert len(threads) == 1
    whole = tok.tokenizer.encode(tok.render(body["messages"], None), add_special_tokens=False).ids
    assert ids(tok.tokens_for(True, body)) == whole
    await tok.warm(True, body)  # all its chunks cached now: nothing to do
    await tok.warm(True, {"messages": [{"role": "user", "content": "short"}]})  # too short to be worth a thread
    await tok.warm(True, {"messages": "not a list"})  # tokens_for will say what is wrong
    assert len(threads) == 1


def test_long_messages_cut_into_chunks_tokenize_exactly_as_whole(model_dir):
    tok = PromptTokenizer(model_dir)
    assert tok._chunked
    rng = random.Random(5)
    alphabet = list("abcdefghij  ,.;:'\"!?()-\n\t0123456789") + ["é", "中", "  ", "\n\n", "'s", " 'll"] + WORDS
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1500, 4000)))
        messages = [{"role": "user", "content": text}]
        assert len(tok._chunks(text)) > 1
        whole = tok.tokenizer.encode(tok.render(messages, None), add_special_tokens=False).ids
        assert ids(tok.chat(messages)) == whole


def test_a_shared_document_ahead_of_unique_questions_is_tokenized_once(model_dir, monkeypatch):
    tok = PromptTokenizer(model_dir)
    doc = " ".join(random.Random(2).choice(WORDS) for _ in range(2000))
    tok.chat([{"role": "user", "content": doc + "\n\nQuestion 0?"}])
    encoded = []
    real = tok.tokenizer.encode
    monkeypatch.setattr(tok, "tokenizer", type("T", (), {"encode": lambda self, t, **k: encoded.append(t) or
                                                         real(t, **k)})())
    tok.chat([{"role": "user", "content": doc + "\n\nQuestion 1?"}])
    assert sum(map(len, encoded)) < 2 * 1024 + 100  # the last chunk or two, not the document
