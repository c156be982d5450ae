"""The emulated engine's prompt side: chat template, tokenization, vLLM-style block hashes, and its independence
from the router's routing-key and index code."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from tokenizer_fixture import write_test_tokenizer
from warmroute.engine.kv_hash import NONE_HASH, block_hashes, low64
from warmroute.engine.tokenizer import PromptTokenizer, SegmentCache, TokenizerError

ENGINE_DIR = Path(__file__).resolve().parents[2] / "warmroute" / "engine"
FORBIDDEN = ("warmroute.core", "warmroute.router")  # the router's routing key, block hash, index, cache


# -- independence ---------------------------------------------------------------------------------------------
def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "warmroute.engine" if node.level else (node.module or "")
            names.add(f"{base}.{node.module}" if node.level and node.module else base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_the_engine_imports_nothing_of_the_router() -> None:
    files = sorted(ENGINE_DIR.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        bad = sorted(n for n in _imports(path) if n.startswith(FORBIDDEN))
        assert not bad, f"{path.name} imports {bad}"


def test_an_engine_with_the_default_tokenizer_loads_no_router_module(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    code = ("import sys, warmroute.engine.cli, warmroute.engine.server, warmroute.engine.tokenizer as t; "
            "print(t.load_tokenizer().directory); print('\\n'.join(sorted(sys.modules)))")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}

    def run() -> list[str]:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                              cwd=ENGINE_DIR.parent.parent).stdout.split()

    first = run()  # writes the tiny model's tokenizer into the cache (its writer uses the workload library)
    out = run()
    assert out[0] == first[0] and Path(out[0]).parent == tmp_path / "warmroute"
    assert "warmroute.engine.server" in out
    assert not [m for m in out if m.startswith(FORBIDDEN)]


def test_the_engine_renders_the_tiny_model_s_template_as_its_vllm_renderer(tmp_path: Path) -> None:
    from warmroute.realengine.hf_model import render_chat, write_tokenizer

    write_tokenizer(tmp_path)
    tok = PromptTokenizer(tmp_path)
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find", "parameters": {"a": 1}}}]
    cases = [
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], tools),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
          "tool_calls": [{"function": {"name": "lookup", "arguments": "{}"}}]}], tools),
    ]
    for messages, tool_list in cases:
        assert tok.render_chat(messages, tool_list) == render_chat(messages, tool_list)


# -- chat template ------------------------------------------------------------------------------------------
def test_chat_template_renders_as_transformers_does(test_tokenizer: PromptTokenizer) -> None:
    text = test_tokenizer.render_chat([{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")  # trim_blocks/lstrip_blocks: no stray newlines
    no_prompt = test_tokenizer.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_prompt.endswith("Hi<|im_end|>\n")


def test_tools_are_rendered_with_tojson_keeping_unicode(test_tokenizer: PromptTokenizer) -> None:
    tool = {"type": "function", "function": {"name": "météo", "parameters": {}}}
    text = test_tokenizer.render_chat([{"role": "user", "content": "?"}], tools=[tool])
    assert json.dumps(tool, ensure_ascii=False) in text


def test_template_kwargs_override_special_tokens_and_bad_data_is_a_value_error(tmp_path: Path) -> None:
    write_test_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] + m['name'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = PromptTokenizer(tmp_path)
    assert tok.render_chat([{"role": "user", "content": "a", "name": "b"}]) == "<|endoftext|>ab"
    assert tok.render_chat([{"role": "user", "content": "a", "name": "b"}], bos_token="") == "ab"
    with pytest.raises(ValueError, match="cannot render"):  # str + int: a TypeError inside the template
        tok.render_chat([{"role": "user", "content": "a", "name": 5}])


def test_content_parts_are_flattened_to_text_joined_by_newlines(test_tokenizer: PromptTokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = test_tokenizer.chat_ids({"messages": [{"role": "user", "content": parts}]})
    as_text = test_tokenizer.chat_ids({"messages": [{"role": "user", "content": "first\nsecond"}]})
    assert as_parts == as_text


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "non-empty list"),
    ({"messages": "hi"}, "non-empty list"),
    ({"messages": [{"content": "x"}]}, "string 'role'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text parts"),
    ({"messages": [{"role": "user", "content": 3}]}, "string or a list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role wizard"),  # raise_exception
    ({"messages": [{"role": "user", "content": "x"}], "tools": {}}, "'tools' must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}, "must be an object"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}, "true or false"),
])
def test_bad_chat_bodies_are_value_errors(test_tokenizer: PromptTokenizer, body: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        test_tokenizer.chat_ids(body)


# -- tokenization -------------------------------------------------------------------------------------------
def test_chat_prompts_get_no_extra_bos_and_text_prompts_do(test_tokenizer: PromptTokenizer) -> None:
    chat = test_tokenizer.chat_ids({"messages": [{"role": "user", "content": "the water"}]})
    assert chat[0] == test_tokenizer.encode("<|im_start|>", add_special_tokens=False)[0] != 0
    text = test_tokenizer.completion_ids("the water")
    assert text[0] == 0 and text[1:] == test_tokenizer.encode("the water", add_special_tokens=False)


def test_completion_prompts_in_every_form_the_api_allows(test_tokenizer: PromptTokenizer) -> None:
    ids = test_tokenizer.completion_ids("the policy of the house")
    assert test_tokenizer.completion_ids(["the policy of the house"]) == ids
    assert test_tokenizer.completion_ids([5, 6, 7]) == [5, 6, 7]  # token ids are used as they are
    assert test_tokenizer.completion_ids([[5, 6, 7]]) == [5, 6, 7]
    assert test_tokenizer.completion_ids("") == [0]  # the BOS alone, as vLLM tokenizes it
    for bad, message in (([["a"], ["b"]], "one prompt"), (["a", "b"], "one prompt"), ([], "empty"),
                         ([[]], "empty"), ([10**9], "out of vocabulary"), (None, "a string, a list"),
                         ([1.5], "a string, a list"), ([True], "a string, a list")):
        with pytest.raises(ValueError, match=message):
            test_tokenizer.completion_ids(bad)


_TEXT = st.lists(st.sampled_from(["the", " water", "<|im_start|>", "<|im_end|>", "\n", " ", "policy", "é",
                                  "<|im_", "end|>", "<|endoftext|>", "  ", "x"]), max_size=40).map("".join)


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(_TEXT, min_size=1, max_size=4))
def test_piecewise_tokenization_equals_the_library_s(test_tokenizer: PromptTokenizer, texts: list[str]) -> None:
    for text in texts + texts:  # the second time from the piece cache
        whole = test_tokenizer._tokenizer.encode(text, add_special_tokens=False).ids
        assert test_tokenizer.encode(text, add_special_tokens=False) == whole


def test_a_text_too_long_for_the_engine_is_refused_before_it_is_tokenized(test_tokenizer: PromptTokenizer) -> None:
    longest = max(map(len, test_tokenizer._tokenizer.get_vocab()))
    assert len(test_tokenizer.encode("x" * 1000, max_tokens=1000)) > 0  # might fit: tokenized
    with pytest.raises(ValueError, match="longer than the 10 tokens"):
        test_tokenizer.encode("x" * (10 * longest + 1), max_tokens=10)
    with pytest.raises(ValueError, match="longer than"):
        test_tokenizer.chat_ids({"messages": [{"role": "user", "content": "x" * 100_000}]}, max_tokens=1000)


def test_piece_cache_is_bounded(test_tokenizer: PromptTokenizer) -> None:
    cache = SegmentCache.for_tokenizer(test_tokenizer._tokenizer)
    assert cache is not None
    cache.max_tokens = 50
    for i in range(100):
        cache.encode(f"<|im_start|>the water number {i} is cold<|im_end|>")
    assert 0 < cache._tokens <= 50 and len(cache._pieces) < 20


def test_a_directory_without_a_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="cannot load a tokenizer"):
        PromptTokenizer(tmp_path)
    write_test_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% if %}"}))
    with pytest.raises(TokenizerError, match="does not compile"):
        PromptTokenizer(tmp_path)
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        PromptTokenizer(tmp_path).chat_ids({"messages": [{"role": "user", "content": "x"}]})
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # newer transformers' file
    assert PromptTokenizer(tmp_path).render_chat([{"role": "user", "content": "x"}]) == "x"


# -- block hashes -------------------------------------------------------------------------------------------
def test_block_hashes_chain_over_the_parent_digest() -> None:
    ids = list(range(40))
    h = block_hashes(ids, 16)
    assert len(h) == 2  # the partial last block is never hashed
    first = hashlib.sha256(NONE_HASH + (16).to_bytes(4, "little")
                           + b"".join(i.to_bytes(4, "little") for i in range(16))).digest()
    assert h[0] == first
    second = hashlib.sha256(first + (16).to_bytes(4, "little")
                            + b"".join(i.to_bytes(4, "little") for i in range(16, 32))).digest()
    assert h[1] == second
    assert low64(h[0]) == int.from_bytes(first[-8:], "big") < 2**64


def test_a_block_hash_names_its_whole_prefix_and_salt() -> None:
    a = block_hashes([1] * 16 + [2] * 16, 16)
    b = block_hashes([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same tokens in block 1, different prefix
    assert block_hashes([1] * 16 + [2] * 16 + [9], 16) == a  # the tail beyond full blocks changes nothing
    salted = block_hashes([1] * 16 + [2] * 16, 16, cache_salt="tenant-a")
    assert salted[0] != a[0] and salted[1] != a[1]
    assert salted != block_hashes([1] * 16 + [2] * 16, 16, cache_salt="tenant-b")
    lora = block_hashes([1] * 32, 16, lora_name="adapter")
    assert lora[0] != block_hashes([1] * 32, 16)[0]
    assert block_hashes([1] * 32, 8) != block_hashes([1] * 32, 16)[:1] * 4
    with pytest.raises(ValueError):
        block_hashes([1], 0)
