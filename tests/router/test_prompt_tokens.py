"""Precise mode's tokenizer: the chat template rendered as vLLM does, cut at added tokens without changing a
single token id, cached, and clear errors for what cannot be read."""

from __future__ import annotations

import random
import struct

import pytest

from warmroute.core.routing_key import KeyError_
from warmroute.bench.tiny_tokenizer import WORDS, write_model_dir
from warmroute.router.prompt_tokens import PromptTokenizer, TokenizerError, Untokenizable

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
    with pytest.raises(Untokenizable, match="no chat template") as caught:
        tok.chat([{"role": "user", "content": "x"}])
    assert caught.value.cause == "no_chat_template"


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


# -- where the chat template comes from: wherever the engine takes it --------------------------------------------
OTHER = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant] {% endif %}")
TOOLS = "{% for m in messages %}<tools>{{ tools | length }} {{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "system", "content": "the cache"}, {"role": "user", "content": "holds keys"}]


def model_with(tmp_path, model_dir, config_template=None, files=None):
    """A copy of the model directory whose template is where a model repository may keep it."""
    import json

    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    config = {"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}
    if config_template is not None:
        config["chat_template"] = config_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_template_in_chat_template_jinja_is_used_and_wins_over_the_config(tmp_path, model_dir):
    from warmroute.bench.tiny_tokenizer import CHATML

    (tmp_path / "a").mkdir()
    only_file = PromptTokenizer(model_with(tmp_path / "a", model_dir, None, {"chat_template.jinja": CHATML}))
    assert only_file.render(MESSAGES, None).startswith("<|im_start|>system\nthe cache<|im_end|>")
    (tmp_path / "b").mkdir()
    both = PromptTokenizer(model_with(tmp_path / "b", model_dir, OTHER, {"chat_template.jinja": CHATML}))
    assert both.render(MESSAGES, None) == only_file.render(MESSAGES, None)  # as transformers loads it
    assert ids(both.chat(MESSAGES)) == both.tokenizer.encode(both.render(MESSAGES, None),
                                                            add_special_tokens=False).ids


def test_templates_from_chat_template_json_and_named_lists(tmp_path, model_dir):
    import json

    (tmp_path / "a").mkdir()
    tok = PromptTokenizer(model_with(tmp_path / "a", model_dir, None,
                                     {"chat_template.json": json.dumps({"chat_template": OTHER})}))
    assert tok.render(MESSAGES, None) == "[system] the cache\n[user] holds keys\n[assistant] "
    (tmp_path / "b").mkdir()
    named = [{"name": "tool_use", "template": TOOLS}, {"name": "default", "template": OTHER}]
    tok = PromptTokenizer(model_with(tmp_path / "b", model_dir, named))
    assert tok.render(MESSAGES, None).startswith("[system] the cache")  # "default"
    assert tok.render(MESSAGES, [{"type": "function"}]).startswith("<tools>1 the cache")  # as transformers picks
    (tmp_path / "c").mkdir()
    with pytest.raises(TokenizerError, match="no 'default' template"):
        PromptTokenizer(model_with(tmp_path / "c", model_dir, [{"name": "rag", "template": OTHER}]))


def test_an_explicit_chat_template_file_or_text_wins_as_vllms_flag_does(tmp_path, model_dir):
    path = tmp_path / "other.jinja"
    path.write_text(OTHER)
    assert PromptTokenizer(model_dir, chat_template=str(path)).render(MESSAGES, None).startswith("[system]")
    assert PromptTokenizer(model_dir, chat_template=OTHER).render(MESSAGES, None).startswith("[system]")
    with pytest.raises(TokenizerError, match="looks like a file path"):
        PromptTokenizer(model_dir, chat_template=str(tmp_path / "missing.jinja"))


def test_templates_that_cannot_work_are_one_startup_line(tmp_path, model_dir):
    (tmp_path / "a").mkdir()
    with pytest.raises(TokenizerError, match=r"chat_template.jinja does not compile"):
        PromptTokenizer(model_with(tmp_path / "a", model_dir, None, {"chat_template.jinja": "{% for %}"}))
    (tmp_path / "b").mkdir()
    refuses = "{{ raise_exception('this template renders nothing') }}"
    with pytest.raises(TokenizerError, match="cannot render a sample conversation.*renders nothing"):
        PromptTokenizer(model_with(tmp_path / "b", model_dir, refuses))
    with pytest.raises(TokenizerError, match=r"cannot load a tokenizer from .*tokenizer.json.*save_pretrained"):
        PromptTokenizer(tmp_path / "b" / "nowhere")


def test_a_template_refusing_system_messages_still_loads_and_says_why_it_refuses(tmp_path, model_dir):
    no_system = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                 "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    (tmp_path / "a").mkdir()
    tok = PromptTokenizer(model_with(tmp_path / "a", model_dir, no_system))
    assert ids(tok.chat(MESSAGES[1:])) == tok.tokenizer.encode("<|im_start|>user\nholds keys<|im_end|>\n",
                                                               add_special_tokens=False).ids
    with pytest.raises(Untokenizable) as caught:
        tok.chat(MESSAGES)
    assert caught.value.cause == "template_refused"
    with pytest.raises(Untokenizable) as caught:
        tok.chat([{"role": "user", "content": {"odd": 1}}])
    assert caught.value.cause == "messages"


def test_a_directory_written_by_transformers_save_pretrained_tokenizes_as_transformers_does(tmp_path):
    """The real thing: the tiny model's tokenizer re-saved by transformers (chat_template.jinja), and the token
    ids transformers' own apply_chat_template makes, next to the router's."""
    import json
    import subprocess

    from transformers_helpers import transformers_python
    from warmroute.realengine.hf_model import resave_with_transformers, write_tokenizer

    python = transformers_python()
    write_tokenizer(tmp_path / "src")
    saved = resave_with_transformers(tmp_path / "src", tmp_path / "saved", python)
    assert (saved / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    conversations = [conversation(turns, seed) for seed, turns in ((1, 1), (2, 4), (3, 9))]
    conversations.append([{"role": "user", "content": [{"type": "text", "text": "naïve 中文"}]}])
    script = ("import json, sys; from transformers import AutoTokenizer;"
              "t = AutoTokenizer.from_pretrained(sys.argv[1]);"
              "print(json.dumps([t.apply_chat_template([{**m, 'content': m['content'] if isinstance(m['content'], str)"
              " else chr(10).join(p['text'] for p in m['content'])} for m in c], add_generation_prompt=True,"
              " tokenize=True, return_dict=False) for c in json.loads(sys.argv[2])]))")
    out = subprocess.run([python, "-c", script, str(saved), json.dumps(conversations)], capture_output=True,
                         text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    tok = PromptTokenizer(saved)
    assert tok.template_origin.endswith("chat_template.jinja")
    assert [ids(tok.chat(c)) for c in conversations] == theirs


@pytest.mark.parametrize("kind, n", [("short", 100_000), ("short-utf", 100_000), ("long", 5_000)])
def test_the_cache_counts_what_its_entries_cost_in_memory(kind, n):
    """Its bound is a memory bound: what it counts is within 25% of the resident memory its entries take (many
    short prompts cost mostly object headers and dictionary slots, which len() does not see: 0.24 of it)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "tokenizer_cache_memory.py"), str(n), kind, "rss"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    ratio = float(out.stdout.rsplit("counted/measured=", 1)[1])
    assert 0.75 < ratio < 1.25, out.stdout
