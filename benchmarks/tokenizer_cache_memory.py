#!/usr/bin/env python3
"""Precise mode's tokenizer cache: what it counts against what it really costs.

    .venv/bin/python benchmarks/tokenizer_cache_memory.py N KIND HOW

Tokenizes N distinct prompts through the cache of `router/prompt_tokens.PromptTokenizer` (no bound), then prints
the bytes the cache counted and the memory it took, measured by HOW: `tracemalloc` (Python's allocations) or `rss`
(the process's resident set, in a run of its own). KIND: short (4 words), medium (31), long (301), short-utf (with
non-ASCII text). Each prompt is made, tokenized and dropped in turn, so what stays is the cache's.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import tempfile
import tracemalloc
from pathlib import Path

from warmroute.bench.tiny_tokenizer import WORDS, write_model_dir
from warmroute.router.prompt_tokens import PromptTokenizer


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def text(rng: random.Random, i: int, kind: str) -> str:
    words = {"short": 3, "medium": 30, "long": 300}[kind.split("-")[0]]
    head = f"q{i} naïve 中文 " if kind.endswith("-utf") else f"q{i} "
    return head + " ".join(rng.choice(WORDS) for _ in range(words))


def measure(n: int, kind: str, how: str) -> tuple[int, int]:
    """(bytes counted, bytes measured) for n distinct prompts of `kind`."""
    directory = Path(tempfile.mkdtemp())
    write_model_dir(directory)
    tok = PromptTokenizer(directory, cache_bytes=1 << 40)
    rng = random.Random(0)
    for i in range(1000):  # the tokenizer's own buffers grow first, outside the measurement
        tok.tokenizer.encode(text(rng, -i, kind), add_special_tokens=False)
    gc.collect()
    if how == "tracemalloc":
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] if how == "tracemalloc" else rss()
    for i in range(n):
        tok._cached(text(rng, i, kind), add_special=False)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0] if how == "tracemalloc" else rss()
    if how == "tracemalloc":
        tracemalloc.stop()
    return tok._cache_bytes, after - before


def main() -> None:
    n, kind, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    counted, real = measure(n, kind, how)
    print(f"{kind:10s} {how:11s} n={n:,} counted={counted / 2**20:7.1f} MiB measured={real / 2**20:7.1f} MiB "
          f"counted/measured={counted / real:.2f}")


if __name__ == "__main__":
    main()
