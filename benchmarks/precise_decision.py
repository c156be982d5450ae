#!/usr/bin/env python3
"""What precise mode adds to a routing decision: tokenizing the request (chat template + tokenizer) and matching
its token blocks against every instance's exact index, for 1k, 8k and 32k-token chat prompts.

    PYTHONPATH=. .venv/bin/python benchmarks/precise_decision.py [--instances 8] [--samples 200] [--model-dir DIR]

Two routers over the same fleet, one with kv_events on, time the server's path to a decision for the same
request bodies, in turns (so both see the same machine load): Router.route (parse, key, decide), after
Router.tokenize_ahead for the precise one (which tokenizes long new text in a worker thread). "loop" is the
time the event loop was busy with it (the worker thread's time taken out), "wall" the request's wait. Each request is a conversation whose earlier messages the
router has seen before (a chat's next turn: only the new user message is new text) — "warm" — or one never seen
— "cold" (every piece tokenized). Every instance's exact index holds the conversations' earlier turns, reported
as KV events with 16-token blocks, and is fresh. Prints p50/p99 in ms of both routers and of the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from warmroute.core.kv_events import BlockStored
from warmroute.router.metrics import Metrics
from warmroute.router.routing import Router
from warmroute.router.settings_load import load_settings

BLOCK = 16
PATH = "/v1/chat/completions"
WORDS = ("the cache of a prefix holds keys and values for every token so later turns skip prefill while the "
         "router sends each request where its history already is").split()


def write_model(directory: Path) -> None:
    try:  # the tiny model's tokenizer (a 4k-token BPE trained on the workloads' text), where it is installed
        from warmroute.realengine.hf_model import write_tokenizer
    except ImportError:
        from warmroute.bench.tiny_tokenizer import write_model_dir

        write_model_dir(directory)
    else:
        write_tokenizer(directory)


def conversation(rng: random.Random, tokens_wanted: int, tokenizer) -> list[dict]:
    """Turns of ~400 words until the rendered prompt has about `tokens_wanted` tokens."""
    messages = [{"role": "system", "content": "You answer questions. " + " ".join(rng.choices(WORDS, k=200))}]
    while len(tokenizer.chat(messages)) // 4 < tokens_wanted:
        role = "user" if messages[-1]["role"] != "user" else "assistant"
        messages.append({"role": role, "content": f"turn {len(messages)}: " + " ".join(rng.choices(WORDS, k=400))})
    if messages[-1]["role"] == "user":
        messages.pop()
    return messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--model-dir", help="a model directory (tokenizer.json, tokenizer_config.json) to use instead")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir:
            tmp = args.model_dir
        else:
            write_model(Path(tmp))
        backends = [f"i{k}=http://127.0.0.1:{9000 + k}" for k in range(args.instances)]
        base = {"backends": backends, "kv_capacity_tokens": 2_000_000}
        plain = Router(load_settings(base, env={}), Metrics("cache_aware", []))
        precise = Router(load_settings({**base, "kv_events": True, "tokenizer": tmp}, env={}),
                         Metrics("cache_aware", []))
        asyncio.run(run(args, plain, precise))


async def timed(router: Router, body: bytes, in_thread: list[float]) -> tuple[float, float]:
    """(wall, loop) seconds to a decision."""
    in_thread.clear()
    start = time.perf_counter()
    parsed = await router.tokenize_ahead(PATH, body) if router.tokenizer is not None else None
    router.route(PATH, body, None, parsed=parsed)
    wall = time.perf_counter() - start
    return wall, wall - sum(in_thread)


async def run(args, plain: Router, precise: Router) -> None:
    rng = random.Random(7)
    exact, tok = precise.exact, precise.tokenizer
    for name in precise.fleet.instances:
        exact.add_instance(name)
        exact.fresh.add(name)
    in_thread: list[float] = []
    encode_all = tok._encode_all

    def encode_timed(todo):
        start = time.perf_counter()
        try:
            return encode_all(todo)
        finally:
            in_thread.append(time.perf_counter() - start)

    tok._encode_all = encode_timed
    print(f"{'prompt':>8} {'case':>5} {'approx p50':>11} {'p99':>7} {'precise loop p50':>17} {'p99':>7} "
          f"{'wall p50':>9} {'p99':>7} {'added loop p50':>15} {'p99':>7}  (ms)")
    for size in (1_000, 8_000, 32_000):
        history = [conversation(rng, size, tok) for _ in range(4)]
        for i, messages in enumerate(history):  # the earlier turns, reported stored by an instance
            ids = list(memoryview(tok.chat(messages, add_generation_prompt=False)).cast("I"))
            n = len(ids) // BLOCK
            exact.apply(f"i{i % args.instances}", [BlockStored(list(range(i << 32, (i << 32) + n)), None,
                                                               ids[: n * BLOCK], BLOCK)])
        for case in ("warm", "cold"):
            plain_t, loop_t, wall_t = [], [], []
            for s in range(args.samples):
                if case == "warm":
                    messages = history[s % len(history)]
                else:  # every message new text (the same length)
                    messages = [{**m, "content": m["content"] + f" #{s}"} for m in history[s % len(history)]]
                body = json.dumps({"model": "m", "messages": messages + [
                    {"role": "user", "content": f"question {s}: " + " ".join(rng.choices(WORDS, k=20))}]}).encode()
                if s % 2:
                    plain_t.append((await timed(plain, body, in_thread))[0])
                wall, loop = await timed(precise, body, in_thread)
                if not s % 2:
                    plain_t.append((await timed(plain, body, in_thread))[0])
                wall_t.append(wall)
                loop_t.append(loop)
            added = [p - a for p, a in zip(loop_t, plain_t)]
            row = [pct(plain_t, 50), pct(plain_t, 99), pct(loop_t, 50), pct(loop_t, 99), pct(wall_t, 50),
                   pct(wall_t, 99), pct(added, 50), pct(added, 99)]
            widths = (11, 7, 17, 7, 9, 7, 15, 7)
            print(f"{size:>8} {case:>5} " + " ".join(f"{v * 1000:>{w}.3f}" for v, w in zip(row, widths)))


def pct(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100)[p - 1] if len(values) > 1 else values[0]


if __name__ == "__main__":
    main()
