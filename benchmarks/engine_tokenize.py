#!/usr/bin/env python3
"""What the emulated engine spends turning a request into cached-block hashes, per 1,000 prompt tokens.

    .venv/bin/python benchmarks/engine_tokenize.py [--workload mixed] [--requests 2000] [--tokenizer DIR]

For the first N requests of a workload (in the order a load generator sends them), times, per request: the chat
template render + tokenization as the engine does it (`PromptTokenizer.chat_ids`, with its cache of recently seen
prompt pieces), the same prompt tokenized whole by the `tokenizers` library with no cache (what a cold engine
or a prompt of all-new text pays), and the vLLM-style block hashing of the ids (`kv_hash.block_hashes`). Prints
µs per 1k tokens (total time / total tokens) and per-request p50/p99 in µs. Times are the thread's CPU time
(`time.thread_time`), so that other tenants of a busy machine inflate them less than wall-clock times.
"""

from __future__ import annotations

import argparse
import statistics
import time

from warmroute.engine.kv_hash import block_hashes
from warmroute.engine.tokenizer import load_tokenizer
from warmroute.workloads.registry import make_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokenizer", metavar="DIR", help="default: the tiny model's")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    tok = load_tokenizer(args.tokenizer)
    bodies = []
    for session in make_workload(args.workload).sessions():
        bodies += [r.body for r in session.requests if "messages" in r.body]
        if len(bodies) >= args.requests:
            break
    bodies = bodies[: args.requests]
    stages: dict[str, list[float]] = {"engine (render + tokenize, piece cache)": [], "library, whole prompt": [],
                                      "block hashes": []}
    tokens = 0
    for body in bodies:
        t0 = time.thread_time()
        ids = tok.chat_ids(body)
        t1 = time.thread_time()
        text = tok.render_chat(body["messages"], body.get("tools"))
        t2 = time.thread_time()
        whole = tok._tokenizer.encode(text, add_special_tokens=False).ids
        t3 = time.thread_time()
        block_hashes(ids, args.block_size)
        t4 = time.thread_time()
        assert whole == ids, "piecewise tokenization differs from the library's"
        tokens += len(ids)
        for name, dt in zip(stages, (t1 - t0, t3 - t2, t4 - t3)):
            stages[name].append(dt)
    print(f"{args.workload}: {len(bodies)} requests, {tokens:,} prompt tokens "
          f"(mean {tokens / len(bodies):,.0f}), tokenizer {tok.directory} (vocab {tok.vocab_size})")
    print(f"{'stage':<42} {'µs/1k tokens':>12} {'p50 µs':>9} {'p99 µs':>9}")
    for name, times in stages.items():
        q = statistics.quantiles(times, n=100)
        print(f"{name:<42} {sum(times) / tokens * 1e9:>12,.0f} {q[49] * 1e6:>9,.0f} {q[98] * 1e6:>9,.0f}")


if __name__ == "__main__":
    main()
