"""A tiny random-weight Llama in Hugging Face format (safetensors + tokenizer.json), so vLLM can serve real
prefill here with no download, and the emulated engine can tokenize exactly as vLLM will.

The tokenizer is a byte-level BPE trained with `tokenizers` on text generated from the repo's own workload
vocabulary (warmroute/workloads/text.py), so the prompts warmroute's workloads send cost about one token per
word, as with a real model's tokenizer. It adds no BOS or EOS of its own: the chat template's text is exactly
what is tokenized. The weights are random (seeded); the output layer favours printable-ASCII tokens, so every
streamed chunk carries text and time to first token is the first token's time.

What vLLM does and `render_chat` mirrors for the emulated engine: a message whose content is a list of parts
is flattened to its text parts joined by a newline before the template sees it, and the template is rendered
in an environment like Hugging Face transformers' (`tojson` keeps key order and non-ASCII characters).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmroute.realengine.random_weights import llama_weights
from warmroute.workloads.text import filler, rng_for

BOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # the end of every turn, and what generation stops at
SPECIAL_TOKENS = (BOS, IM_START, IM_END)
VOCAB_SIZE = 4096  # the trainer stops earlier when the corpus has no more pairs worth merging
CORPUS_PARAGRAPHS = 2000
MODEL_MAX_LENGTH = 8192

# Every newline is emitted from an expression and every tag trims whitespace, so the text does not depend on the
# environment's trim_blocks/lstrip_blocks (transformers sets both; a plain jinja2 Environment neither).
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n# Tools\\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{{- '- ' + fn['name'] + ': ' + (fn['description'] or '') + ' ' + ((fn['parameters'] or {}) | tojson) + '\\n' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- for call in (message['tool_calls'] or []) -%}"
    "{{- '<tool_call>' + call['function']['name'] + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class HfModelSpec:
    hidden: int = 128
    layers: int = 2
    heads: int = 4  # head size hidden/heads = 32: one vLLM's CPU attention supports
    intermediate: int = 256
    max_positions: int = MODEL_MAX_LENGTH
    dtype: str = "bfloat16"  # what vLLM computes in; the file holds float32, which vLLM casts on load
    seed: int = 0
    name: str = "warmroute-tiny"

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads


def training_corpus(seed: int = 0) -> Iterator[str]:
    """Chat turns of the workloads' filler, each opened by the kinds of header the workloads put on texts
    ("Request 12.3: ", "[doc 7] ", "[1f] "), so roles, numbers and brackets get tokens of their own too."""
    rng = rng_for(seed, "tokenizer-corpus")
    for i in range(CORPUS_PARAGRAPHS):
        role = ("system", "user", "assistant")[i % 3]
        head = (f"Request chat-{i}.{i % 7}: ", f"[doc {i}] ", f"[{i * 2654435761 % 65536:x}] ")[i % 3]
        yield f"{IM_START}{role}\n{head}{filler(rng, rng.randint(200, 800))}{IM_END}\n"


def train_tokenizer(seed: int = 0):
    """The byte-level BPE tokenizer (a `tokenizers.Tokenizer`), special tokens first (ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_corpus(seed), trainer)
    return tokenizer


def write_tokenizer(directory: str | Path, seed: int = 0) -> Path:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json to
    `directory` (same seed, same bytes); return the tokenizer.json path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    train_tokenizer(seed).save(str(path), pretty=False)
    special = {"bos_token": BOS, "eos_token": IM_END, "pad_token": BOS, "unk_token": None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MODEL_MAX_LENGTH,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE, **special}
    _write_json(directory / "tokenizer_config.json", config)
    _write_json(directory / "special_tokens_map.json", {k: v for k, v in special.items() if v is not None})
    return path


def write_hf_model(directory: str | Path, spec: HfModelSpec = HfModelSpec()) -> Path:
    """Write the model and its tokenizer to `directory` (same spec, same bytes); return the directory."""
    from tokenizers import Tokenizer
    from safetensors.numpy import save_file

    if spec.hidden % spec.heads:
        raise ValueError("hidden must be a multiple of heads")
    directory = Path(directory)
    tokenizer = Tokenizer.from_file(str(write_tokenizer(directory, spec.seed)))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    special_ids = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
    _write_json(directory / "config.json", _config(spec, vocab, special_ids))
    _write_json(directory / "generation_config.json", {"bos_token_id": special_ids[BOS],
                                                        "eos_token_id": special_ids[IM_END]})
    tensors = dict(llama_weights(spec.seed, vocab, spec.hidden, spec.intermediate, spec.layers,
                                 _printable_ids(tokenizer), HF_NAMES))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


# Run by the interpreter that has transformers (vLLM's): the tokenizer as transformers itself saves it.
_RESAVE = ("import sys; from transformers import AutoTokenizer; "
           "AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def resave_with_transformers(source: str | Path, target: str | Path, python: str) -> Path:
    """A copy of the model directory `source` whose tokenizer files are what `transformers`' own save_pretrained
    writes (current versions: the chat template in chat_template.jinja, not in tokenizer_config.json), run with
    `python` (an interpreter that has transformers: vLLM's). RuntimeError, with transformers' last line, if it
    fails."""
    import shutil
    import subprocess

    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name not in TOKENIZER_FILES:
            shutil.copy2(f, target / f.name)
    done = subprocess.run([python, "-c", _RESAVE, str(source), str(target)], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"transformers could not re-save the tokenizer of {source}: {last}")
    return target


def render_chat(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, template: str = CHAT_TEMPLATE) -> str:
    """The prompt text vLLM renders from an OpenAI chat request with this model's template."""
    flat = [{**m, "content": _flatten(m.get("content"))} for m in messages]
    return _environment().from_string(template).render(messages=flat, tools=list(tools or []) or None,
                                                       add_generation_prompt=add_generation_prompt)


def _flatten(content: Any) -> Any:
    """vLLM's "string" content format: a list of parts becomes its text parts joined by newlines."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env


def _config(spec: HfModelSpec, vocab: int, special_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": spec.name,
        "hidden_size": spec.hidden, "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.heads, "head_dim": spec.head_size,
        "max_position_embeddings": spec.max_positions, "vocab_size": vocab, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": spec.dtype,
        "bos_token_id": special_ids[BOS], "eos_token_id": special_ids[IM_END], "attention_bias": False,
        "mlp_bias": False,
    }


def _printable_ids(tokenizer) -> list[int]:
    """Tokens that decode to printable ASCII on their own (no special token, no partial UTF-8)."""
    out = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        if tokenizer.id_to_token(token_id) in SPECIAL_TOKENS:
            continue
        text = tokenizer.decode([token_id])
        if text and all(0x20 <= ord(c) < 0x7F for c in text):
            out.append(token_id)
    return out


# Transformers' Llama names for llama_weights' roles.
HF_NAMES = {"embed": "model.embed_tokens.weight", "attn_norm": "model.layers.{i}.input_layernorm.weight",
            **{p: f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkvo"},
            "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
            **{p: f"model.layers.{{i}}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
            "norm": "model.norm.weight", "head": "lm_head.weight"}


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
