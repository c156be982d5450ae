"""A small model directory (tokenizer.json with ChatML's added tokens, tokenizer_config.json with its chat
template) for precise mode's tests and benchmarks, made without a download."""

from __future__ import annotations

import json
import random
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "the cache of a prefix holds keys and values for every token so later turns skip prefill".split()


def write_model_dir(directory: Path, template: str | None = CHATML) -> None:
    """A small byte-level BPE with ChatML's added tokens, as a model directory holds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(50)) for _ in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
