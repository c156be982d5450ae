#!/usr/bin/env python3
"""Precise mode against a real vLLM (CPU): one instance publishing its KV-cache events, the router in front.

    PYTHONPATH=. .venv/bin/python benchmarks/precise_vllm.py [--vllm-python .venv-vllm/bin/python] [--docs 3]
        [--questions 4] [--model-dir DIR]

Uses the tiny random-weight Llama and its tokenizer (warmroute/realengine/hf_model.py) unless --model-dir names
another, starts one vLLM through `warmroute fleet`'s VllmFleet (KV events and replay on 127.0.0.1), then a router with
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
import sys
import tempfile
from pathlib import Path

import aiohttp

from warmroute.bench.stats import percentile
from warmroute.realengine.vllm_fleet import (VllmFleet, VllmFleetSpec, VllmInstance, VllmMissing, find_vllm_python,
                                             shared_tiny_model)
from warmroute.router.app import ROUTER
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings



def chat(doc: int, question: int) -> dict:
    system = f"[doc {doc}] " + " ".join(f"Clause {doc}.{i}: the parties agree to term {i * 7 + doc}." for i in range(60))
    return {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"Question {question}: what does clause "
                                                                          f"{question} say?"}]}


async def router_for(model: Path, vllm: VllmInstance, precise: bool = True):
    events = {"kv_events_endpoint": f"tcp://127.0.0.1:{vllm.events_port}",
              "kv_events_replay_endpoint": f"tcp://127.0.0.1:{vllm.replay_port}"}
    extra = {"kv_events": True, "tokenizer": str(model), "kv_events_topic": "kv-events"} if precise else {}
    return await start_router(load_settings({
        "backends": [{"name": "v0", "url": vllm.url, **events}], "port": 0, "engine_metrics": False, **extra},
        env={}))


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
    return f"median {percentile(errors, 50):.0f}, p90 {percentile(errors, 90):.0f} tokens"


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
    python = find_vllm_python(args.vllm_python)
    model = Path(args.model_dir) if args.model_dir else shared_tiny_model(python)
    spec = VllmFleetSpec(model_dir=model, count=1, served_model_name="tiny", python=python)
    with VllmFleet(spec, work) as fleet:
        await fleet.wait_ready()
        vllm = fleet.instances[0]
        print(f"vLLM up at {vllm.url} (logs in {work})", flush=True)
        routers = []
        try:
            await compare(args, model, vllm, routers)
        finally:
            for router in routers:
                await router.stop()


async def compare(args: argparse.Namespace, model: Path, vllm: VllmInstance, routers: list) -> None:
    """Precise mode, a replica started late, then approximate mode on other documents (routers kept in
    `routers` for the caller to stop)."""
    routers.append(await router_for(model, vllm))
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
        routers.append(await router_for(model, vllm))  # a replica started late
        reason, prompt, predicted, cached = await ask(client, routers[1], chat(0, args.questions))
        print(f"late replica: {reason}, predicted {predicted}, vLLM cached {cached} of {prompt}")
        routers.append(await router_for(model, vllm, precise=False))  # other documents: cold in vLLM
        print("approximate mode (kv_events off), other documents:")
        approximate = await one_pass(client, routers[2], range(args.docs, 2 * args.docs), args.questions)
        print(f"|predicted - cached|: precise {summary(precise)}; approximate {summary(approximate)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", help="the interpreter with vLLM (default: as `warmroute fleet` finds it)")
    ap.add_argument("--model-dir", help="a model directory to use instead of writing the tiny one")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--questions", type=int, default=4)
    args = ap.parse_args()
    try:
        find_vllm_python(args.vllm_python)
    except VllmMissing as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
    with tempfile.TemporaryDirectory(prefix="warmroute-precise-vllm-") as work:
        asyncio.run(run(args, Path(work)))


if __name__ == "__main__":
    main()
