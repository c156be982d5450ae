#!/usr/bin/env python3
"""Precise mode against a real vLLM (CPU): one instance publishing its KV-cache events, the router in front.

    PYTHONPATH=. .venv/bin/python benchmarks/precise_vllm.py [--vllm-python .venv-vllm/bin/python] [--docs 3]
        [--questions 4] [--model-dir DIR]

Writes the tiny random-weight Llama and its tokenizer (warmroute/realengine/hf_model.py) unless --model-dir has
one, starts vLLM with --kv-events-config (events on an ipc socket, replay on 127.0.0.1), then a router with
kv_events on. Sends `docs` x `questions` chats (each document ~1.2k tokens, then a question), one at a time,
and prints per request the reason, the tokens vLLM reported cached and the router's prediction (the
x-warmroute-predicted-hit share x vLLM's prompt tokens); then the exact index's state and the router's KV-event
metrics; then starts a second router (a replica started late) and asks it once more; then a router with
kv_events off sends the same pattern with other documents, and the prediction errors of both are summarised.
Stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from warmroute.router.app import ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(doc: int, question: int) -> dict:
    system = f"[doc {doc}] " + " ".join(f"Clause {doc}.{i}: the parties agree to term {i * 7 + doc}." for i in range(60))
    return {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"Question {question}: what does clause "
                                                                          f"{question} say?"}]}


async def start_vllm(python: str, model: Path, work: Path) -> tuple[subprocess.Popen, int, dict]:
    port, replay = free_port(), free_port()
    events = {"kv_events_endpoint": f"ipc://{work}/events", "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
              "endpoint": events["kv_events_endpoint"], "replay_endpoint": events["kv_events_replay_endpoint"]}
    args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--block-size", "32", "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "4096",
            "--disable-uvicorn-access-log", "--kv-events-config", json.dumps(config)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_CACHE_ROOT": str(Path(python).resolve().parents[1] / "vllm-cache")}
    log = open(work / "vllm.log", "w")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    start = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited: see {work / 'vllm.log'}")
            try:
                async with s.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1)
    print(f"vLLM up in {time.monotonic() - start:.0f} s", flush=True)
    return proc, port, events


async def router_for(model: Path, port: int, events: dict, precise: bool = True):
    extra = {"kv_events": True, "tokenizer": str(model), "kv_events_topic": "kv-events"} if precise else {}
    return await start_router(load_settings({
        "backends": [{"name": "v0", "url": f"http://127.0.0.1:{port}", **events}], "port": 0,
        "engine_metrics": False, **extra}, env={}))


async def one_pass(client: aiohttp.ClientSession, router, docs: range, questions: int) -> list[int]:
    """The chats, one at a time, printed; returns |predicted - cached| of each."""
    errors = []
    for q in range(questions):
        for doc in docs:
            reason, prompt, predicted, cached = await ask(client, router, chat(doc, q))
            errors.append(abs(predicted - cached))
            print(f"{doc:>3} {q:>2} {reason:<28} {prompt:>6} {predicted:>9} {cached:>11}", flush=True)
    return errors


def summary(errors: list[int]) -> str:
    ranked = sorted(errors)
    return f"median {ranked[len(ranked) // 2]}, p90 {ranked[min(len(ranked) - 1, int(0.9 * len(ranked)))]} tokens"


async def ask(client: aiohttp.ClientSession, router, body: dict) -> tuple[str, int, int, int]:
    async with client.post(router.url + "/v1/chat/completions", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise SystemExit(f"request failed: {r.status} {data}")
        share, reason = float(r.headers["x-warmroute-predicted-hit"]), r.headers["x-warmroute-reason"]
    usage = data["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return reason, usage["prompt_tokens"], round(share * usage["prompt_tokens"]), cached


async def run(args: argparse.Namespace, work: Path) -> None:
    model = Path(args.model_dir) if args.model_dir else work / "model"
    if not (model / "config.json").exists():
        from warmroute.realengine.hf_model import write_hf_model

        write_hf_model(model)
    proc, port, events = await start_vllm(args.vllm_python, model, work)
    routers = []
    try:
        routers.append(await router_for(model, port, events))
        async with aiohttp.ClientSession() as client:
            print(f"{'doc':>3} {'q':>2} {'reason':<28} {'prompt':>6} {'predicted':>9} {'vLLM cached':>11}")
            precise = await one_pass(client, routers[0], range(args.docs), args.questions)
            exact = routers[0].app[ROUTER].exact
            blocks = exact.instances["v0"]
            print(f"fresh: {sorted(exact.fresh)}; blocks {exact.size('v0')} of {blocks.block_size} tokens; "
                  f"orphans {blocks.orphans}, partial {blocks.partial}")
            async with client.get(routers[0].url + "/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith("warmroute_kv_") and "_created" not in line:
                        print(line)
            routers.append(await router_for(model, port, events))  # a replica started late
            reason, prompt, predicted, cached = await ask(client, routers[1], chat(0, args.questions))
            print(f"late replica: {reason}, predicted {predicted}, vLLM cached {cached} of {prompt}")
            routers.append(await router_for(model, port, events, precise=False))  # other documents: cold in vLLM
            print("approximate mode (kv_events off), other documents:")
            approximate = await one_pass(client, routers[2], range(args.docs, 2 * args.docs), args.questions)
            print(f"|predicted - cached|: precise {summary(precise)}; approximate {summary(approximate)}")
    finally:
        for router in routers:
            await router.stop()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--model-dir", help="a model directory to use instead of writing the tiny one")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--questions", type=int, default=4)
    args = ap.parse_args()
    if not Path(args.vllm_python).exists():
        print(f"no vLLM at {args.vllm_python} (--vllm-python)", file=sys.stderr)
        raise SystemExit(2)
    with tempfile.TemporaryDirectory(prefix="warmroute-precise-vllm-") as work:
        asyncio.run(run(args, Path(work)))


if __name__ == "__main__":
    main()
