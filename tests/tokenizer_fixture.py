"""A small real tokenizer for the emulated engine's tests: byte-level BPE trained here with `tokenizers` on the
workloads' filler text, saved as Hugging Face saves one (tokenizer.json + tokenizer_config.json with a
ChatML chat template), so the tests do not depend on the tiny model's own tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from warmroute.workloads.text import filler, rng_for

BOS = "<|endoftext|>"
CHATML = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_test_tokenizer(directory: Path, vocab_size: int = 1024) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = rng_for(0, "test-tokenizer")
    tok.train_from_iterator((filler(rng, 2000) for _ in range(200)), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": {"content": "<|im_end|>", "special": True},
              "chat_template": CHATML, "model_max_length": 8192}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
