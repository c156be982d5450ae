"""`warmroute make-tiny-model PATH`: write the tiny random-weight GGUF model llama.cpp can serve here."""

from __future__ import annotations

import argparse
import time

from warmroute.errors import UsageError
from warmroute.realengine.tiny_model import TinyModelSpec, write_tiny_model

_DEFAULT = TinyModelSpec()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="the .gguf file to write")
    parser.add_argument("--n-embd", type=int, default=_DEFAULT.n_embd, help=f"width (default {_DEFAULT.n_embd})")
    parser.add_argument("--n-layer", type=int, default=_DEFAULT.n_layer, help=f"layers (default {_DEFAULT.n_layer})")
    parser.add_argument("--n-head", type=int, default=_DEFAULT.n_head, help=f"heads (default {_DEFAULT.n_head})")
    parser.add_argument("--n-ff", type=int, default=_DEFAULT.n_ff, help=f"FFN width (default {_DEFAULT.n_ff})")
    parser.add_argument("--n-ctx", type=int, default=_DEFAULT.n_ctx,
                        help=f"trained context length (default {_DEFAULT.n_ctx})")
    parser.add_argument("--seed", type=int, default=_DEFAULT.seed, help="weights' seed (default 0)")


def run(args: argparse.Namespace) -> int:
    spec = TinyModelSpec(n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head, n_ff=args.n_ff,
                         n_ctx=args.n_ctx, seed=args.seed)
    if min(spec.n_embd, spec.n_layer, spec.n_head, spec.n_ff, spec.n_ctx) < 1 or spec.n_embd % spec.n_head:
        raise UsageError("sizes must be positive and --n-embd a multiple of --n-head")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UsageError("needs the gguf package: pip install 'warmroute[llama]'") from None
    start = time.perf_counter()
    try:
        path = write_tiny_model(args.path, spec)
    except OSError as exc:
        raise UsageError(f"cannot write {args.path}: {exc.strerror or exc}") from None
    size = path.stat().st_size
    print(f"wrote {path} ({size / 2**20:.1f} MiB, n_embd {spec.n_embd}, {spec.n_layer} layers, "
          f"{spec.n_head} heads, n_ff {spec.n_ff}, context {spec.n_ctx}, vocab {spec.n_vocab}) "
          f"in {time.perf_counter() - start:.2f} s")
    return 0
