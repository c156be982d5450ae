"""Seeded random weights of a llama-architecture model, under whatever names its file format gives them.

The GGUF model (tiny_model.py, for llama.cpp) and the Hugging Face one (hf_model.py, for vLLM) draw the same
tensors in the same order; only the names differ.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np


def llama_weights(seed: int, vocab: int, hidden: int, ff: int, layers: int, printable: Sequence[int],
                  names: Mapping[str, str]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array), shapes (out, in). `names` maps each role (embed, attn_norm, q, k, v, o, ffn_norm,
    gate, up, down, norm, head) to the format's name, `{i}` standing for the layer. The head gives large random
    logits to the `printable` tokens and zero to the others, so sampling only ever picks those."""
    rng = np.random.default_rng(seed)
    h = hidden

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    yield names["embed"], rng.standard_normal((vocab, h)).astype(np.float32)
    for i in range(layers):
        yield names["attn_norm"].format(i=i), np.ones(h, np.float32)
        for part in ("q", "k", "v", "o"):
            yield names[part].format(i=i), dense(h, h)
        yield names["ffn_norm"].format(i=i), np.ones(h, np.float32)
        yield names["gate"].format(i=i), dense(ff, h)
        yield names["up"].format(i=i), dense(ff, h)
        yield names["down"].format(i=i), dense(h, ff)
    yield names["norm"], np.ones(h, np.float32)
    head = np.zeros((vocab, h), np.float32)
    head[list(printable)] = rng.standard_normal((len(printable), h)) * (10 / np.sqrt(h))
    yield names["head"], head
