"""The tiny Hugging Face-format model: same seed, same bytes; its tokenizer and chat template work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from warmroute.cli import main
from warmroute.realengine.hf_model import BOS, IM_END, IM_START, HfModelSpec, render_chat, write_hf_model, \
    write_tokenizer
from warmroute.workloads.text import filler, rng_for


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    a = _files(write_hf_model(tmp_path / "a"))
    assert a == _files(write_hf_model(tmp_path / "b"))
    assert set(a) >= {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                      "tokenizer_config.json", "special_tokens_map.json"}
    c = _files(write_hf_model(tmp_path / "c", HfModelSpec(seed=1)))
    assert c["model.safetensors"] != a["model.safetensors"]


def test_tokenizer_alone_is_deterministic(tmp_path: Path) -> None:
    first = write_tokenizer(tmp_path / "x").read_bytes()
    assert write_tokenizer(tmp_path / "y").read_bytes() == first


def test_config_matches_tokenizer_and_weights(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    spec = HfModelSpec(hidden=64, layers=1, heads=2, intermediate=96)
    directory = write_hf_model(tmp_path / "m", spec)
    config = json.loads((directory / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    assert 2000 <= vocab <= 5000
    assert (config["vocab_size"], config["head_dim"], config["num_hidden_layers"]) == (vocab, 32, 1)
    assert config["eos_token_id"] == tokenizer.token_to_id(IM_END)
    weights = load_file(str(directory / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (vocab, 64)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (64, 96)
    assert "model.layers.1.input_layernorm.weight" not in weights
    head = weights["lm_head.weight"]
    assert not head[tokenizer.token_to_id(IM_START)].any()  # special tokens are never sampled
    assert head[tokenizer.token_to_id("Ġthe")].any()


def test_tokenizer_round_trips_text_at_about_a_token_per_word(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_file(str(write_tokenizer(tmp_path)))
    text = filler(rng_for(7, "check"), 4000) + " naïve café 12345 {\"a\": [1, 2]}\n\ttabs"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert 3.5 <= len(text) / len(ids) <= 7  # whole common words, not bytes
    assert tokenizer.encode(" the refund policy").tokens == ["Ġthe", "Ġrefund", "Ġpolicy"]


def test_chat_template_renders_chatml_and_tokenizes_its_special_tokens(tmp_path: Path) -> None:
    directory = tmp_path / "tok"
    tokenizer = Tokenizer.from_file(str(write_tokenizer(directory)))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == (BOS, IM_END)
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    text = render_chat(messages, template=config["chat_template"])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert render_chat(messages, add_generation_prompt=False).endswith("there<|im_end|>\n")
    encoding = tokenizer.encode(text)
    assert encoding.tokens[0] == IM_START and encoding.tokens.count(IM_END) == 2  # one token each, no BOS added
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text


def test_tools_come_first_in_a_system_block() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find an order.",
                                               "parameters": {"type": "object", "properties": {"id": {}}}}}]
    text = render_chat([{"role": "user", "content": "Where is it?"}], tools=tools)
    assert text.startswith('<|im_start|>system\n# Tools\n- lookup: Find an order. '
                           '{"type": "object", "properties": {"id": {}}}\n<|im_end|>\n<|im_start|>user\n')
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "lookup", "arguments": "{}"}}]}
    assert "<|im_start|>assistant\n<tool_call>lookup</tool_call><|im_end|>" in render_chat([call])


def test_make_tiny_model_hf_command(tmp_path: Path, capsys) -> None:
    assert main(["make-tiny-model", "--format", "hf", str(tmp_path / "m"), "--n-layer", "1"]) == 0
    assert "hidden 128, 1 layers, 4 heads of 32" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 1
    (tmp_path / "file").write_text("x")
    assert main(["make-tiny-model", "--format", "hf", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["make-tiny-model", "--format", "hf", str(tmp_path / "n"), "--n-head", "3"]) == 2


@pytest.mark.parametrize("flag", ["--n-layer", "--n-embd"])
def test_make_tiny_model_rejects_non_positive_sizes(tmp_path: Path, flag: str, capsys) -> None:
    assert main(["make-tiny-model", str(tmp_path / "m.gguf"), flag, "0"]) == 2
    assert "positive" in capsys.readouterr().err
