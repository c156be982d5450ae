"""A tiny random-weight llama-architecture GGUF model, so llama.cpp can serve real prefill on these CPUs.

No model can be downloaded here, and the router's benefit shows in prefill time, not in what the model says:
so the weights are random (seeded, so every run writes the same bytes) and the dimensions are chosen so that
a few thousand prompt tokens take about a second to prefill on one thread, while a cached prefix answers in
tens of milliseconds.

The vocabulary is SentencePiece-style: `<unk>`, `<s>`, `</s>`, the 256 byte tokens `<0x00>`..`<0xFF>` and
"▁" (U+2581). llama.cpp's SPM tokenizer rewrites every space as "▁" before falling back to bytes; without
that one piece a space would cost three byte tokens, with it every ASCII byte is exactly one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from warmroute.realengine.random_weights import llama_weights

SPACE_PIECE = "\u2581"
PRINTABLE = range(0x20, 0x7F)  # the only bytes the model will say (random bytes would be invalid UTF-8)
BYTE_OFFSET = 3  # token id of <0x00>, after <unk> <s> </s>


@dataclass(frozen=True)
class TinyModelSpec:
    n_embd: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_ff: int = 512
    n_ctx: int = 8192
    seed: int = 0
    name: str = "warmroute-tiny"

    @property
    def n_vocab(self) -> int:
        return len(vocabulary()[0])

    def kv_bytes_per_token(self) -> int:
        """f16 K and V of every layer: what one cached token costs in llama.cpp's state."""
        return 2 * self.n_layer * self.n_embd * 2


def vocabulary() -> tuple[list[str], list[int]]:
    """Token pieces and their llama.cpp token types, in id order."""
    from gguf import TokenType

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), SPACE_PIECE]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256, TokenType.NORMAL]
    return pieces, [int(t) for t in types]


def write_tiny_model(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the model to `path` (same spec, same bytes) and return the path."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "llama")
    _add_metadata(writer, spec)
    for name, tensor in llama_weights(spec.seed, spec.n_vocab, spec.n_embd, spec.n_ff, spec.n_layer,
                                      [BYTE_OFFSET + b for b in PRINTABLE], GGUF_NAMES):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_metadata(writer, spec: TinyModelSpec) -> None:
    pieces, types = vocabulary()
    writer.add_name(spec.name)
    writer.add_context_length(spec.n_ctx)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head)
    writer.add_rope_dimension_count(spec.n_embd // spec.n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)  # all f32
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * len(pieces))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


# llama.cpp's names for llama_weights' roles.
GGUF_NAMES = {"embed": "token_embd.weight", "attn_norm": "blk.{i}.attn_norm.weight",
              **{p: f"blk.{{i}}.attn_{p}.weight" for p in "qkv"}, "o": "blk.{i}.attn_output.weight",
              "ffn_norm": "blk.{i}.ffn_norm.weight", **{p: f"blk.{{i}}.ffn_{p}.weight" for p in ("gate", "up", "down")},
              "norm": "output_norm.weight", "head": "output.weight"}
