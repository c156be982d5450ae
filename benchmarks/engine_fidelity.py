#!/usr/bin/env python3
"""Does the emulated engine over HTTP keep to its model? The same requests, at the same times, both ways.

    .venv/bin/python benchmarks/engine_fidelity.py [--rate 3] [--requests 200] [--time-scale 1] [--workload mixed]

Starts one emulated instance (`warmroute engine`, the 8b profile), sends it the workload's requests straight (no
router) at Poisson times (--rate per modelled second), each on its own (a session's later turns are sent as
independent requests), and times each to its first token. Then replays the same requests, tokenized as the
engine tokenizes them, into a fresh `EngineModel` in virtual time, each arriving when it was sent. Prints TTFT
p50/p90/p99 in modelled ms both ways and the per-request difference. A difference of a few ms is the HTTP path
and the event loop; more means the driver (engine/driver.py) does not run the model as modelled, and every HTTP
benchmark on emulated engines (and its agreement with the simulator) would inherit it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from warmroute.bench.client import send
from warmroute.bench.formats import markdown_table
from warmroute.bench.processes import Child, free_ports
from warmroute.bench.record import OUT, command_line, now_utc, tree_state, write_outputs
from warmroute.bench.stats import percentile
from warmroute.engine.kv_hash import block_hashes
from warmroute.engine.model import EngineConfig, EngineModel
from warmroute.engine.tokenizer import load_tokenizer
from warmroute.workloads import WorkloadRequest, make_workload


def requests(workload: str, n: int) -> list[WorkloadRequest]:
    out: list[WorkloadRequest] = []
    for session in make_workload(workload, seed=3, max_tokens=16).sessions():
        out += [r for r in session.requests if "messages" in r.body]
        if len(out) >= n:
            return out[:n]
    return out


async def over_http(reqs: list[WorkloadRequest], rate: float, time_scale: float) -> list[tuple[float, float]]:
    """(sent, TTFT) per request, in modelled seconds from the first send."""
    port = free_ports(1)
    with Child("engine", ["engine", "--count", "1", "--port", str(port), "--time-scale", str(time_scale)],
               Path(tempfile.mkdtemp(prefix="fidelity-"))) as engine:
        await engine.wait_for_log("listening on", 1, timeout_s=60)
        target = f"http://127.0.0.1:{port}"
        model = await engine.wait_for_model(target)
        rng, due = random.Random(1), 0.0
        async with aiohttp.ClientSession() as http:
            t0 = time.perf_counter()
            tasks = []
            for req in reqs:
                due += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, t0 + due * time_scale - time.perf_counter()))
                tasks.append(asyncio.create_task(send(http, target, req, model=model, t0=t0, timeout_s=600)))
            recs = await asyncio.gather(*tasks)
    if not all(r.ok for r in recs):
        raise SystemExit(f"{sum(not r.ok for r in recs)} requests failed")
    return [(r.start_s / time_scale, r.ttft_s / time_scale) for r in recs]


def in_virtual_time(reqs: list[WorkloadRequest], sent: list[float]) -> list[float]:
    """TTFT per request (s) of the same requests in a fresh EngineModel, stepped as the simulator steps it."""
    tok, model = load_tokenizer(), EngineModel(EngineConfig.from_profile("8b"))
    arrivals = []
    for i, req in enumerate(reqs):
        ids = tok.chat_ids(req.body)
        arrivals.append((sent[i], i, block_hashes(ids, model.config.block_size), len(ids), req.max_tokens))
    arrivals.sort()
    now, j, ttft = 0.0, 0, [0.0] * len(reqs)
    while j < len(arrivals) or not model.idle:
        if model.idle:
            now = max(now, arrivals[j][0])
        while j < len(arrivals) and arrivals[j][0] <= now:  # what arrived during the step joins the next one
            _, i, hashes, n, max_tokens = arrivals[j]
            model.submit(i, hashes, n, max(1, max_tokens))
            j += 1
        step = model.step(1)
        now += step.duration
        for i in step.first_tokens:
            ttft[i] = now - sent[i]
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=3.0, help="requests per modelled second")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--json", type=Path, default=OUT / "engine_fidelity.json")
    args = parser.parse_args()
    reqs = requests(args.workload, args.requests)
    sent, http = zip(*asyncio.run(over_http(reqs, args.rate, args.time_scale)))
    virtual = in_virtual_time(reqs, list(sent))

    rows = {"over HTTP": list(http), "model, virtual time": virtual,
            "difference per request": [h - v for h, v in zip(http, virtual)]}
    ms = {name: [round(1000 * percentile(xs, q), 1) for q in (50, 90, 99)] for name, xs in rows.items()}
    table = markdown_table(["TTFT, modelled ms", "p50", "p90", "p99"], "lrrr",
                           ([name, *map(str, v)] for name, v in ms.items()))
    head = (f"`{command_line(__file__, sys.argv[1:])}` ({now_utc()}, {tree_state()}): {len(reqs)} {args.workload} "
            f"requests at {args.rate:g}/s, time scale {args.time_scale:g}")
    print(head, *table, sep="\n")
    write_outputs(args.json, {"argv": sys.argv[1:], "ttft_ms": ms}, "\n".join([head, "", *table]))


if __name__ == "__main__":
    main()
