"""`warmroute make-tiny-model PATH`: write a tiny random-weight model a real engine can serve here.

`--format gguf` (default): one .gguf file for llama.cpp. `--format hf`: a directory in Hugging Face format
(config.json, model.safetensors, tokenizer.json with a chat template) for vLLM and the emulated engine.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from warmroute.errors import UsageError
from warmroute.realengine.hf_model import HfModelSpec, write_hf_model
from warmroute.realengine.tiny_model import TinyModelSpec, write_tiny_model

_GGUF = TinyModelSpec()
_HF = HfModelSpec()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="the .gguf file (gguf) or the directory (hf) to write")
    parser.add_argument("--format", choices=("gguf", "hf"), default="gguf",
                        help="gguf: for llama.cpp (default); hf: safetensors + tokenizer, for vLLM")
    parser.add_argument("--n-embd", type=int, help=f"width (default {_GGUF.n_embd} gguf, {_HF.hidden} hf)")
    parser.add_argument("--n-layer", type=int, help=f"layers (default {_GGUF.n_layer})")
    parser.add_argument("--n-head", type=int,
                        help=f"heads (default {_GGUF.n_head}); for vLLM on CPUs the head size must be 32, 64, 80, ...")
    parser.add_argument("--n-ff", type=int, help=f"FFN width (default {_GGUF.n_ff} gguf, {_HF.intermediate} hf)")
    parser.add_argument("--n-ctx", type=int, help=f"trained context length (default {_GGUF.n_ctx})")
    parser.add_argument("--seed", type=int, default=0, help="weights' (and hf tokenizer's) seed (default 0)")


def run(args: argparse.Namespace) -> int:
    sizes = (args.n_embd, args.n_layer, args.n_head, args.n_ff, args.n_ctx)
    if any(v is not None and v < 1 for v in sizes):
        raise UsageError("sizes must be positive")
    start = time.perf_counter()
    try:
        described = _write_hf(args) if args.format == "hf" else _write_gguf(args)
    except OSError as exc:
        raise UsageError(f"cannot write {args.path}: {exc.strerror or exc}") from None
    print(f"wrote {described} in {time.perf_counter() - start:.2f} s")
    return 0


def _given(**values: int | None) -> dict[str, int]:
    return {k: v for k, v in values.items() if v is not None}


def _write_gguf(args: argparse.Namespace) -> str:
    spec = replace(_GGUF, seed=args.seed, **_given(n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
                                                   n_ff=args.n_ff, n_ctx=args.n_ctx))
    if spec.n_embd % spec.n_head:
        raise UsageError("--n-embd must be a multiple of --n-head")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UsageError("needs the gguf package: pip install 'warmroute[llama]'") from None
    path = write_tiny_model(args.path, spec)
    return (f"{path} ({path.stat().st_size / 2**20:.1f} MiB, n_embd {spec.n_embd}, {spec.n_layer} layers, "
            f"{spec.n_head} heads, n_ff {spec.n_ff}, context {spec.n_ctx}, vocab {spec.n_vocab})")


def _write_hf(args: argparse.Namespace) -> str:
    spec = replace(_HF, seed=args.seed, **_given(hidden=args.n_embd, layers=args.n_layer, heads=args.n_head,
                                                 intermediate=args.n_ff, max_positions=args.n_ctx))
    if spec.hidden % spec.heads:
        raise UsageError("--n-embd must be a multiple of --n-head")
    path = Path(args.path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} exists and is not a directory")
    write_hf_model(path, spec)
    size = sum(f.stat().st_size for f in path.iterdir())
    return (f"{path}/ ({size / 2**20:.1f} MiB, hidden {spec.hidden}, {spec.layers} layers, {spec.heads} heads "
            f"of {spec.head_size}, intermediate {spec.intermediate}, context {spec.max_positions})")
