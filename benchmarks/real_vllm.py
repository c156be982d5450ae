#!/usr/bin/env python3
"""warmroute in front of 2 real vLLM instances on CPUs, against every prefix pinned by hand.

    .venv/bin/python benchmarks/real_vllm.py [--rounds 3] [--duration 20] [--warmup 5] [--json FILE]
        [--workload shared|rag|mixed|chat] [--contenders random,prefix,cache_aware,precise]
        [--model-dir config|transformers]

Needs vLLM (`python3 dev.py vllm`). Starts 2 vLLM instances once (the tiny model, one core each, a KV cache
smaller than the workload's working set), then per round runs every contender once, in an order rotated each
round, on the same shared-prefix traffic (equally popular system prompts, short unique questions, closed
loop), each instance's prefix cache reset before every run:

  pinned            each prefix sent by the client straight to one instance (prefix i to instance i mod 2)
  pinned_forwarder  the same pinning through a plain TCP forwarder (warmroute.bench.tcp_forwarder)
  session           the same pinning through warmroute's `session` strategy (one `user` per prefix)
  random, prefix, cache_aware   warmroute's strategies
  precise           cache_aware with the engines' KV-cache events (it asks each vLLM where it publishes); its
                    router starts after the engines served the runs before it, so it catches up by replay: the
                    seconds from its launch until it is in step with every instance are reported
                    (fresh_s), and its figures against pinned_forwarder's

`--workload rag` is KV pressure in llm-d's shape instead: equally popular documents whose contexts fill 75% of
the fleet's KV cache (as vLLM reports it), a unique question each; `--workload mixed` is the demo's blend,
`--workload chat` multi-turn chats.
The pinned contenders need the shared-prefix workload.

Reports medians over rounds (and ranges) of the engines' own prefix-cache hit rate (vllm:prefix_cache_hits
over queries in the measured window), TTFT p50/p99, requests/s, the proxy's CPU per request, and the median
|router-predicted − engine-reported cached tokens| per request (warmroute's contenders). The `user`
labels are chosen (with the router's rendezvous hash) so `session` places each prefix where `pinned` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import count
from pathlib import Path
from typing import Any, ClassVar

import aiohttp

from warmroute.bench.cpu import process_cpu_s
from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.processes import Child, free_ports
from warmroute.bench.record import write_outputs
from warmroute.bench.scrape import fetch_metrics
from warmroute.core.rendezvous import top
from warmroute.core.stages.affinity import hash_text
from warmroute.prometheus_text import read_samples, sample_sum
from warmroute.realengine.vllm_fleet import (VllmFleet, VllmFleetSpec, VllmMissing, find_vllm_python,
                                             shared_saved_tiny_model, shared_tiny_model)
from warmroute.router.engine_metrics import parse_engine_metrics
from warmroute.workloads import Session, Workload, make_workload
from warmroute.workloads.shared import SharedPrompts

CONTENDERS = ("pinned", "pinned_forwarder", "session", "random", "prefix", "cache_aware")
ROUTED = ("random", "prefix", "cache_aware", "precise")  # the contenders any workload can have
PINNED = ("pinned", "pinned_forwarder", "session")
MODEL = "warmroute-tiny"
HEADER = re.compile(r"\[system prompt (\d+)\]")


@dataclass
class Labelled(Workload):
    """Another workload's requests, each with `user` naming its system prompt's label (the session id)."""

    name: ClassVar[str] = "labelled"
    inner: Workload = field(default_factory=SharedPrompts)
    labels: dict[int, str] = field(default_factory=dict)

    def sessions(self) -> Iterator[Session]:
        for s in self.inner.sessions():
            requests = tuple(replace(r, body={**r.body, "user": self.labels[prefix_of(r.body)]}) for r in s.requests)
            yield Session(s.id, requests)

    def working_set_tokens(self, concurrency: int = 1) -> int:
        return self.inner.working_set_tokens(concurrency)


def prefix_of(body: dict[str, Any]) -> int:
    return int(HEADER.match(body["messages"][0]["content"]).group(1))


def labels_pinned_like(prefixes: int, names: list[str]) -> dict[int, str]:
    """For each prefix i, a `user` label the session strategy sends to names[i mod n] (the first that does)."""
    out = {}
    for i in range(prefixes):
        out[i] = next(f"prefix-{i}-{k}" for k in count() if top(hash_text(f"prefix-{i}-{k}"), names)
                      == names[i % len(names)])
    return out


async def reset_caches(urls: list[str]) -> None:
    async with aiohttp.ClientSession() as s:
        for url in urls:
            async with s.post(url + "/reset_prefix_cache") as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}/reset_prefix_cache answered {r.status}")


async def run_one(contender: str, args: argparse.Namespace, fleet: VllmFleet, workload: Workload,
                  forwarder: tuple[Child, list[str]], log_dir: Path) -> dict[str, Any]:
    """Reset both caches, then warm up and measure one contender; its proxy's CPU is read around the window."""
    urls = fleet.urls
    await reset_caches(urls)
    if contender.startswith("pinned"):
        pinned = urls if contender == "pinned" else forwarder[1]
        return await measure(args, pinned[0], workload, urls, contender,
                             route=lambda req: pinned[prefix_of(req.body) % len(pinned)],
                             pid=forwarder[0].pid if contender == "pinned_forwarder" else None)
    port = free_ports(1, fleet.instances[-1].port + 10)
    strategy = ["--strategy", "cache_aware", "--kv-events", "--tokenizer", str(fleet.spec.model_dir)] \
        if contender == "precise" else ["--strategy", contender]
    argv = ["serve", "--port", str(port), *strategy, "--block-bytes", str(4 * args.block_size),
            *(a for i in fleet.instances for a in ("--backend", f"{i.name}={i.url}"))]
    launched = asyncio.get_running_loop().time()
    with Child(f"router-{contender}", argv, log_dir) as router:
        target = f"http://127.0.0.1:{port}"
        await router.wait_for_http(target + "/health", timeout_s=60)
        names = [i.name for i in fleet.instances]
        fresh_s = await seconds_to_fresh(target, names, launched) if contender == "precise" else None
        figures = await measure(args, target, workload, urls, contender, route=None, pid=router.proc.pid)
        if contender == "precise":  # started after the engines served the earlier runs: caught up how fast?
            async with aiohttp.ClientSession() as s:
                text, = await fetch_metrics(s, [target + "/metrics"])
            untokenized = sample_sum(text, "warmroute_precise_untokenized_total") or 0
            figures.update(fresh_s=fresh_s, untokenized=untokenized,
                           stale_after=sample_sum(text, "warmroute_kv_events_stale"))
        return figures


async def seconds_to_fresh(router: str, names: list[str], began: float, limit_s: float = 60.0) -> float | None:
    """Seconds from `began` (the router's launch, on the loop's clock) until its exact index is in step with every
    instance (its warmroute_kv_events_stale gauge 0 for each); None if not within limit_s."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        while loop.time() - began < limit_s:
            text, = await fetch_metrics(s, [router + "/metrics"])
            stale = read_samples(text, ("warmroute_kv_events_stale",)).get("warmroute_kv_events_stale", [])
            if {labels["backend"] for labels, value in stale if value == 0} >= set(names):
                return round(loop.time() - began, 2)
            await asyncio.sleep(0.05)
    return None


async def measure(args: argparse.Namespace, target: str, workload: Workload, urls: list[str], label: str,
                  route: Any, pid: int | None) -> dict[str, Any]:
    """An unmeasured warm-up run, then the measured one (the engines' counters and the proxy's CPU around it)."""
    def settings(duration: float) -> BenchSettings:
        return BenchSettings(concurrency=args.concurrency, duration_s=duration, warmup_s=0.0, model=MODEL,
                             engine_metrics=[u + "/metrics" for u in urls], label=label, drain_s=30.0, route=route)

    await run_bench(target, workload, settings(args.warmup))
    before = process_cpu_s(pid) if pid else 0.0
    result = await run_bench(target, workload, settings(args.duration))
    s = result.summary()
    sent = s["requests"] + len(result.errors)
    return {"hit_rate": s["hit_rate"]["fleet"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p99_ms": s["ttft_ms"]["p99"], "req_per_s": s["throughput"]["requests_per_s"],
            "errors": len(result.errors), "requests": s["requests"],
            "prediction_error_median_tokens": s["prediction_error_tokens"]["median_abs"],
            "prediction_error_p90_tokens": s["prediction_error_tokens"]["p90_abs"],
            "requests_by_instance": s["instances"]["requests"],
            "proxy_cpu_ms_per_req": round(1000 * (process_cpu_s(pid) - before) / sent, 2) if pid and sent else None}


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if isinstance(r[key], (int, float))]
        out[key] = (statistics.median(values), min(values), max(values)) if values else None
    return out


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    rows = ["| contender | hit rate | TTFT p50 ms | TTFT p99 ms | req/s | proxy CPU ms/req | \\|prediction error\\| "
            "p50 / p90, tokens | errors |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def cell(m: tuple[float, float, float] | None, fmt: str) -> str:
        if m is None:
            return "-"
        return f"{fmt.format(m[0])} ({fmt.format(m[1])}–{fmt.format(m[2])})"

    for name, runs in results.items():
        m = medians(runs)
        rows.append(f"| {name} | {cell(m['hit_rate'], '{:.1%}')} | {cell(m['ttft_p50_ms'], '{:.0f}')} | "
                    f"{cell(m['ttft_p99_ms'], '{:.0f}')} | {cell(m['req_per_s'], '{:.1f}')} | "
                    f"{cell(m['proxy_cpu_ms_per_req'], '{:.2f}')} | {cell(m['prediction_error_median_tokens'], '{:.0f}')} / "
                    f"{cell(m['prediction_error_p90_tokens'], '{:.0f}')} | "
                    f"{sum(r['errors'] for r in runs)} |")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per run (default 20)")
    p.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds per run (default 5)")
    p.add_argument("--concurrency", type=int, default=6, help="closed-loop clients (default 6)")
    p.add_argument("--prefixes", type=int, default=12, help="equally popular system prompts (default 12)")
    p.add_argument("--system-tokens", type=int, default=1900,
                   help="system prompt size in warmroute's 4-characters-a-token units (default 1900: ~1,500 "
                        "tokens of the tiny model's tokenizer)")
    p.add_argument("--kv-cache-bytes", type=int, default=12 << 20, help="per instance (default 12 MiB)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--workload", choices=("shared", "rag", "mixed", "chat"), default="shared")
    p.add_argument("--contenders", help=f"default: {','.join(CONTENDERS)} (shared), {','.join(ROUTED)} (others)")
    p.add_argument("--model-dir", choices=("config", "transformers"), default="config",
                   help="the tiny model as written here (chat template in tokenizer_config.json) or as transformers' "
                        "save_pretrained writes it (chat_template.jinja)")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    args = p.parse_args()
    args.contenders = (args.contenders or ",".join(CONTENDERS if args.workload == "shared" else ROUTED)).split(",")
    unknown = [c for c in args.contenders if c not in CONTENDERS + ROUTED]
    if unknown or (args.workload != "shared" and set(args.contenders) & set(PINNED)):
        p.error(f"contenders for --workload {args.workload}: "
                f"{', '.join(CONTENDERS + ('precise',) if args.workload == 'shared' else ROUTED)}")
    return args


async def main(args: argparse.Namespace) -> int:
    python = find_vllm_python()
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between runs
    log_dir = Path(tempfile.mkdtemp(prefix="real-vllm-"))
    model_dir = shared_saved_tiny_model(python) if args.model_dir == "transformers" else shared_tiny_model(python)
    spec = VllmFleetSpec(model_dir=model_dir, count=2, kv_cache_bytes=args.kv_cache_bytes,
                         block_size=args.block_size, python=python)
    contenders = args.contenders
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    with VllmFleet(spec, log_dir) as fleet:
        print(f"starting 2 vLLM instances (logs in {log_dir}) ...", file=sys.stderr, flush=True)
        await fleet.wait_ready()
        names = [i.name for i in fleet.instances]
        workload = await workload_for(args, fleet, names)
        ports = free_ports(len(names), fleet.instances[-1].port + 20)
        pairs = [f"{ports + k}={i.port}" for k, i in enumerate(fleet.instances)]
        with Child("forwarder", pairs, log_dir, module="warmroute.bench.tcp_forwarder") as forward:
            await forward.wait_for_log("forwarding", 1, timeout_s=30)
            forwarder = (forward, [f"http://127.0.0.1:{ports + k}" for k in range(len(names))])
            for r in range(args.rounds):
                order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
                for c in order:
                    figures = await run_one(c, args, fleet, workload, forwarder, log_dir)
                    results[c].append(figures)
                    print(f"round {r + 1} {c}: {json.dumps(figures)}", file=sys.stderr, flush=True)
    print(table(results))
    print(versus(results, "precise", "pinned_forwarder"))
    if args.json:
        write_outputs(args.json, results)
    return 0


def versus(results: dict[str, list[dict[str, Any]]], a: str, b: str) -> str:
    """a's median hit rate and requests/s as multiples of b's, and how fast a (precise) came in step."""
    if not results.get(a) or not results.get(b):
        return ""
    ma, mb = medians(results[a]), medians(results[b])
    line = (f"{a} / {b}: hit rate x{ma['hit_rate'][0] / mb['hit_rate'][0]:.3f}, "
            f"req/s x{ma['req_per_s'][0] / mb['req_per_s'][0]:.3f}")
    fresh = [r.get("fresh_s") for r in results[a]]
    if any(f is not None or "fresh_s" in r for f, r in zip(fresh, results[a])):
        untokenized = sum(r.get("untokenized", 0) for r in results[a])
        line += (f"; every instance in step {', '.join('never' if f is None else f'{f:.2f}' for f in fresh)} s after "
                 f"the router's launch; requests it could not tokenize: {untokenized:.0f}")
    return line


async def workload_for(args: argparse.Namespace, fleet: VllmFleet, names: list[str]) -> Workload:
    if args.workload in ("mixed", "chat"):
        return make_workload(args.workload, seed=0, model=MODEL, max_tokens=args.max_tokens)
    if args.workload == "rag":
        capacity = sum([await kv_capacity_tokens(u) for u in fleet.urls])
        doc_tokens = 1200  # warmroute's 4-character units: ~950 tokens of the tiny model's tokenizer
        docs = max(2, int(0.75 * capacity / (doc_tokens * 0.8)))
        print(f"rag: {docs} documents of ~{int(doc_tokens * 0.8)} tokens for {capacity} KV tokens in all",
              file=sys.stderr, flush=True)
        return make_workload("rag", seed=0, model=MODEL, max_tokens=args.max_tokens, docs=docs,
                             doc_tokens=doc_tokens, question_tokens=150, zipf=0.0, systems=1, system_tokens=50)
    inner = SharedPrompts(seed=0, model=MODEL, max_tokens=args.max_tokens, pool_size=args.prefixes,
                          system_tokens=args.system_tokens, question_tokens=40, zipf=0.0)
    return Labelled(inner=inner, labels=labels_pinned_like(args.prefixes, names))


async def kv_capacity_tokens(url: str) -> int:
    """num_gpu_blocks x block_size, from the instance's vllm:cache_config_info (read as the router reads it)."""
    async with aiohttp.ClientSession() as s:
        text, = await fetch_metrics(s, [url + "/metrics"])
    capacity = parse_engine_metrics(text).capacity_tokens
    if capacity is None:
        raise RuntimeError(f"{url}/metrics has no vllm:cache_config_info")
    return capacity


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so every `with` block stops its processes (the vLLM instances, a router)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        raise SystemExit(asyncio.run(main(parse_args())))
    except VllmMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
