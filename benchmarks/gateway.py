#!/usr/bin/env python3
"""warmroute behind Envoy as its endpoint picker, beside `warmroute serve`, Envoy alone, and no router at all.

    .venv/bin/python benchmarks/gateway.py [--rounds N] [--duration S] [--phases saturation latency]

Issue #20's measurements, in one run on one machine, with warmroute.bench's raw-socket load generator and CPU
accounting, and the saturation benchmark's fleets and windows (warmroute.bench.saturation):

(a) Saturation throughput on 4 trivial instances (warmroute.bench.trivial): a closed loop of 128 keep-alive
    connections sending small chat completions (every other one streamed, 8 tokens). Contenders:
      direct            straight to the instances
      serve             `warmroute serve --strategy cache_aware`
      envoy             Envoy alone: round robin over the instances, no picker (what Envoy itself costs)
      envoy+epp         deploy/envoy/envoy.yaml: Envoy (ORIGINAL_DST), `warmroute epp --strategy cache_aware`
                        reading request headers and body and the response's headers and streamed body
      envoy+epp hdrs    the same with response_body_mode NONE: the picker sees no response body (no usage
                        feedback, first token taken at the response headers), one message less per chunk
      envoy+null hdrs   hdrs' processing modes with benchmarks/null_picker.py as the picker (grpcio, no routing
                        code: round robin): the floor of a Python grpcio picker
      envoy+null obs    the null picker on the request side, and the response headers and body sent to it by a
                        second ext_proc filter in observability_mode (Envoy does not wait for its answers)
      envoy+epp lean    request headers and body only (response side SKIP/NONE: 2 messages; the books close when
                        Envoy ends the stream with the HTTP stream, but no status, first token or feedback)
      envoy+epp duplex  lean with the request body FULL_DUPLEX_STREAMED: Envoy sends headers and body without
                        waiting for the headers' answer (one round trip before the upstream request)
      smg               the SGLang Model Gateway (`smg launch --policy cache_aware`, compare_peers' command line,
                        from the peers' virtualenv, --peers-venv)
    Envoy runs with one worker thread (--concurrency 1). Each router's CPU is reported per request, the
    picker's and Envoy's separately.
(b) Added time to first token at 64 concurrent streams (paced trivial instances, tokens 20 ms apart, 32 tokens):
    each of 64 sessions sends the same streamed request straight to an instance and through the router at
    the same moment. Added = routed percentile - direct percentile.

(c) Where the picker's time goes: the same ext_proc streams (request headers, buffered body, response headers,
    one response body chunk; or the first 3 or 2 of them) from a gRPC client in another process, answered by a
    null ext_proc service (an empty answer to each message: grpcio's own cost) on grpcio's asyncio API and on
    its sync API (thread pool), and by `warmroute epp` in front of stub instances; CPU of the serving process per
    stream.

Writes out/gateway.json (everything measured) and out/gateway.md: the section "Envoy + warmroute epp
(issue #20)" of docs/benchmarks.md, to be pasted there by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmroute.bench import compare_peers as cp
from warmroute.bench import saturation as sat
from warmroute.bench.formats import markdown_table, pct
from warmroute.bench.processes import Child, free_ports
from warmroute.bench.rawload import hostport
from warmroute.bench.record import OUT, command_line, load_average, log, now_utc, tree_state, write_outputs
from warmroute.bench.stats import percentile, to_ms
from warmroute.gateway.envoy import FALLBACKS, ORIGINAL_DST, EnvoyConfig, EnvoyProcess, local_listener

SECTION = "Envoy + warmroute epp (issue #20)"
CONTENDERS = ["direct", "serve", "smg", "envoy", "envoy+null hdrs", "envoy+null obs", "envoy+epp", "envoy+epp hdrs", "envoy+epp lean",
              "envoy+epp duplex"]
KV_CAPACITY = sat.KV_CAPACITY


@dataclass
class Stack:
    """A router under test: its processes (label -> Child, for the CPU meter) and the URL clients use."""

    label: str
    url: str
    processes: dict[str, Child] = field(default_factory=dict)


@dataclass
class Running:
    """The instances and every stack in front of them (warmroute.bench.saturation's Running, with several processes per
    router)."""

    fleet: sat.FleetSpec
    children: list[Child]
    urls: list[str]
    stacks: dict[str, Stack]
    model: str = ""
    envoys: list[EnvoyProcess] = field(default_factory=list)
    peers_venv: Path = cp.PEERS_VENV

    @property
    def routers(self) -> dict[str, tuple[Child, str]]:  # what warmroute.bench.saturation's windows read
        return {label: (next(iter(s.processes.values())), s.url) for label, s in self.stacks.items()}

    def sids(self) -> dict[str, list[int]]:
        groups = {"instances": [c.proc.pid for c in self.children]}
        for stack in self.stacks.values():
            for part, child in stack.processes.items():
                groups[f"{stack.label}/{part}"] = [child.proc.pid]
        return groups

    def stop(self) -> None:
        for stack in self.stacks.values():
            for child in stack.processes.values():
                child.stop()
        for c in self.children:
            c.stop()
        for e in self.envoys:
            e.stop()


def _plain_envoy(name: str, port: int, engines: list[tuple[str, int]]) -> tuple[dict, list[dict]]:
    """The fallbacks configuration without its picker and its override_host policy: Envoy alone, round robin."""
    listener, clusters = local_listener(FALLBACKS, name, port, ("127.0.0.1", 1), engines)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.router"]
    pool = [c for c in clusters if c["name"] == f"{name}-pool"]
    pool[0].pop("load_balancing_policy")
    return listener, pool


# The picker's processing modes in each variant (over deploy/envoy/envoy.yaml's).
VARIANTS: dict[str, dict[str, str]] = {
    "envoy+epp": {},
    "envoy+null hdrs": {"response_body_mode": "NONE"},
    "envoy+null obs": {"response_header_mode": "SKIP", "response_body_mode": "NONE"},
    "envoy+epp hdrs": {"response_body_mode": "NONE"},
    "envoy+epp lean": {"response_header_mode": "SKIP", "response_body_mode": "NONE"},
    "envoy+epp duplex": {"request_body_mode": "FULL_DUPLEX_STREAMED", "request_trailer_mode": "SEND",
                         "response_header_mode": "SKIP", "response_body_mode": "NONE"},
}


# The response side in a second ext_proc filter that Envoy does not wait for (observability_mode).
OBSERVED = {"envoy+null obs"}
_OBSERVER_MODES = {"request_header_mode": "SKIP", "request_body_mode": "NONE", "response_header_mode": "SEND",
                   "response_body_mode": "STREAMED"}


def _processing_mode(listener: dict, modes: dict[str, str], observer: bool = False) -> None:
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    for at, f in enumerate(filters):
        if f["name"] == "envoy.filters.http.ext_proc":
            f["typed_config"]["processing_mode"].update(modes)
            if observer:
                second = copy.deepcopy(f)
                second["name"] = "envoy.filters.http.ext_proc.observer"
                second["typed_config"]["observability_mode"] = True
                second["typed_config"]["processing_mode"] = dict(_OBSERVER_MODES)
                filters.insert(at + 1, second)
            return


async def _start_envoy(running: Running, label: str, admin: int, listener: dict, clusters: list[dict],
                       logs: Path) -> Child:
    config = EnvoyConfig(admin)
    config.add(listener, clusters)
    envoy = EnvoyProcess(config)
    running.envoys.append(envoy)
    proc = Child.command(f"{_name(label)}-envoy", envoy.argv(), logs)
    await envoy.wait_ready(proc.proc)
    return proc


def _name(label: str) -> str:
    return label.replace(" ", "-").replace("+", "-")


async def start_stack(running: Running, label: str, listen: int, kv_capacity: int, logs: Path, tag: str) -> Stack:
    """One router in front of `running`'s instances, on ports listen..listen+3 (listener, control, picker's gRPC,
    Envoy's admin); returns once it serves a completion."""
    engines = [hostport(u) for u in running.urls]
    stack = running.stacks[label] = Stack(label, f"http://127.0.0.1:{listen}")
    if label in ("serve", "smg"):
        peer = cp.Contender(label, "warmroute" if label == "serve" else "smg", "cache_aware")
        argv = peer.argv(listen, listen + 1, running.urls, kv_capacity, running.peers_venv)
        stack.processes["router"] = Child.command(f"{tag}-{label}", argv, logs)
    elif label == "envoy":
        stack.processes["envoy"] = await _start_envoy(running, f"{tag}-{label}", listen + 3,
                                                      *_plain_envoy("plain", listen, engines), logs)
    else:
        control, grpc_port = listen + 1, listen + 2
        argv = [sys.executable, "-m", "warmroute", "epp", "--port", str(control), "--epp-port", str(grpc_port),
                "--strategy", "cache_aware", "--kv-capacity-tokens", str(kv_capacity), "--log-level", "warning"]
        argv += [a for i, u in enumerate(running.urls) for a in ("--backend", f"e{i}={u}")]
        if label.startswith("envoy+null"):
            argv = [sys.executable, str(Path(__file__).with_name("null_picker.py")), str(grpc_port),
                    *(f"{h}:{p}" for h, p in engines)]
        stack.processes["picker"] = Child.command(f"{tag}-{_name(label)}", argv, logs)
        listener, clusters = local_listener(ORIGINAL_DST, _name(label), listen, ("127.0.0.1", grpc_port))
        _processing_mode(listener, VARIANTS[label], observer=label in OBSERVED)
        stack.processes["envoy"] = await _start_envoy(running, f"{tag}-{label}", listen + 3, listener, clusters, logs)
    await next(iter(stack.processes.values())).wait_for_model(stack.url)
    return stack


async def start(fleet: sat.FleetSpec, labels: list[str], logs: Path, tag: str, peers_venv: Path) -> Running:
    port = free_ports(fleet.instances)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(fleet.instances)]
    children = fleet.children(port, logs, f"{tag}-instances")
    running = Running(fleet, children, urls, {}, peers_venv=peers_venv)
    next_port = port + fleet.instances
    try:
        for child, count in zip(children, fleet.counts()):
            await child.wait_for_log("listening on", count, timeout_s=60)
        running.model = await children[0].wait_for_model(urls[0])
        for label in labels:
            if label != "direct":
                listen = free_ports(4, next_port)
                next_port = listen + 4
                await start_stack(running, label, listen, KV_CAPACITY, logs, tag)
    except BaseException:
        running.stop()
        raise
    return running


def _contender(label: str) -> sat.Contender:
    return sat.Contender(label, {"direct": None, "smg": "smg"}.get(label, "warmroute"))


async def phase_saturation(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    fleet = sat.FleetSpec("stub")
    log(f"== (a) saturation, {fleet.describe()}")
    running = await start(fleet, args.contenders, logs, "sat", args.peers_venv)

    def line(c: sat.Contender, res: dict[str, Any]) -> str:
        cpu = res["cpu_cores"]
        parts = " ".join(f"{k.split('/', 1)[1]} {v:.2f}" for k, v in cpu.items() if k.startswith(c.label + "/"))
        return (f"{res['rps']:>8,.0f} req/s  errors {sum(res['errors'].values())}  cores: {parts} instances "
                f"{cpu['instances']:.2f} loadgen {cpu['load generator']:.2f} other {cpu['other processes']:.2f}")

    try:
        return await sat.run_rounds(running, [_contender(c) for c in args.contenders], args, sat.saturation_window,
                                    line)
    finally:
        running.stop()


async def phase_latency(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    fleet = sat.FleetSpec("stub", itl_ms=args.itl_ms)
    routed = [c for c in args.contenders if c != "direct"]
    log(f"== (b) added latency, {args.streams} concurrent streams, {fleet.describe()}")
    running = await start(fleet, routed, logs, "lat", args.peers_venv)

    def line(c: sat.Contender, res: dict[str, Any]) -> str:
        s = sat.latency_summary(res["pairs"])
        return (f"{len(res['pairs']):>6} pairs  errors {sum(res['errors'].values())}  TTFT p50 {s['direct_p50']} -> "
                f"{s['router_p50']} ms, p99 {s['direct_p99']} -> {s['router_p99']} ms")

    try:
        return await sat.run_rounds(running, [_contender(c) for c in routed], args, sat.latency_window, line)
    finally:
        running.stop()


# -- (c) the picker's CPU per stream, against grpcio alone ----------------------------------------------------------
STREAM_BODY = json.dumps({"model": "m", "messages": [{"role": "system", "content": sat.SYSTEM_PROMPTS[0]},
                                                     {"role": "user", "content": "What is 2 + 2?"}]}).encode()


def _stream_messages() -> list[Any]:
    from envoy.config.core.v3 import base_pb2 as core
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    def headers(pairs: dict[str, str]) -> Any:
        return ep.HttpHeaders(headers=core.HeaderMap(
            headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))

    usage = b'{"usage": {"prompt_tokens": 80, "prompt_tokens_details": {"cached_tokens": 64}}}'
    return [ep.ProcessingRequest(request_headers=headers({":path": "/v1/chat/completions", ":method": "POST",
                                                          "content-length": str(len(STREAM_BODY))})),
            ep.ProcessingRequest(request_body=ep.HttpBody(body=STREAM_BODY, end_of_stream=True)),
            ep.ProcessingRequest(response_headers=headers({":status": "200", "content-type": "application/json"})),
            ep.ProcessingRequest(response_body=ep.HttpBody(body=usage, end_of_stream=True))]


def stream_client(target: str, streams: int, concurrency: int, messages: int, out: Any) -> None:
    """In a process of its own: `streams` ext_proc streams of the first `messages` messages, `concurrency` at a
    time; puts (the seconds taken, each stream's seconds from its first message to its last answer)."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    sent = _stream_messages()[:messages]
    took: list[float] = []

    async def run() -> float:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            gate = asyncio.Semaphore(concurrency)

            async def one() -> None:
                async with gate:
                    call = stub.Process()
                    t0 = time.perf_counter()
                    for m in sent:
                        await call.write(m)
                        await call.read()
                    took.append(time.perf_counter() - t0)
                    await call.done_writing()
                    await call.code()  # the server's side of the stream is over too

            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(streams)))
            return time.perf_counter() - t0

    out.put((asyncio.run(run()), took))


async def _serve_streams(target: str, streams: int, messages: int,
                         concurrency: int = 32) -> tuple[float, float, list[float]]:
    """(server CPU seconds, wall seconds, each stream's seconds) while a client process runs `streams` streams
    against `target`."""
    import multiprocessing
    import resource

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    client = ctx.Process(target=stream_client, args=(target, streams, concurrency, messages, out))
    before = resource.getrusage(resource.RUSAGE_SELF)
    client.start()
    while client.is_alive():
        await asyncio.sleep(0.02)
    after = resource.getrusage(resource.RUSAGE_SELF)
    wall, took = out.get()
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), wall, took


# Messages per stream in (c): with the response body, response headers only, the request only.
STREAM_SHAPES = {4: "req hdrs, body, resp hdrs, resp body", 3: "req hdrs, body, resp hdrs", 2: "req hdrs, body"}
SERVICES = ["null, asyncio API", "null, sync API (thread pool)", "warmroute epp"]
LONE_STREAMS = 300  # streams one at a time: how long a stream's messages take when nothing else is in flight


def _null_services() -> tuple[Any, Any]:
    """(asyncio servicer, sync servicer) answering each message with an empty ProcessingResponse."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    class AsyncNull(ep_grpc.ExternalProcessorServicer):
        async def Process(self, requests: Any, context: Any) -> None:
            while await context.read() is not grpc.aio.EOF:
                await context.write(ep.ProcessingResponse())

    class SyncNull(ep_grpc.ExternalProcessorServicer):
        def Process(self, requests: Any, context: Any) -> Iterator[Any]:
            for _ in requests:
                yield ep.ProcessingResponse()

    return AsyncNull(), SyncNull()


async def phase_picker(args: argparse.Namespace) -> list[dict[str, Any]]:
    from concurrent import futures

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    from warmroute.gateway.server import start_picker
    from warmroute.router.settings_load import load_settings

    log(f"== (c) picker CPU per ext_proc stream, {args.picker_streams} streams per window")
    fleet = sat.FleetSpec("stub")
    port = free_ports(fleet.instances)
    async_null, sync_null = _null_services()
    with tempfile.TemporaryDirectory(prefix="warmroute-gateway-bench-") as tmp:
        children = fleet.children(port, Path(tmp), "picker-instances")
        try:
            for child, count in zip(children, fleet.counts()):
                await child.wait_for_log("listening on", count, timeout_s=60)
            null = grpc.aio.server()
            ep_grpc.add_ExternalProcessorServicer_to_server(async_null, null)
            null_port = null.add_insecure_port("127.0.0.1:0")
            await null.start()
            threads = grpc.server(futures.ThreadPoolExecutor(max_workers=40))  # one thread per open stream
            ep_grpc.add_ExternalProcessorServicer_to_server(sync_null, threads)
            sync_port = threads.add_insecure_port("127.0.0.1:0")
            threads.start()
            picker = await start_picker(load_settings({
                "backends": [f"e{i}=http://127.0.0.1:{port + i}" for i in range(fleet.instances)], "port": 0,
                "epp_port": 0, "kv_capacity_tokens": KV_CAPACITY, "health_interval": 3600, "log_level": "warning"},
                env={}))
            ports = dict(zip(SERVICES, (null_port, sync_port, picker.grpc_port)))
            out = []
            try:
                for r in range(args.rounds):
                    for messages in STREAM_SHAPES:
                        for label in (SERVICES if r % 2 == 0 else SERVICES[::-1]):
                            target = f"127.0.0.1:{ports[label]}"
                            cpu, wall, _ = await _serve_streams(target, args.picker_streams, messages)
                            _, _, alone = await _serve_streams(target, LONE_STREAMS, messages, concurrency=1)
                            out.append({"contender": label, "messages": messages, "round": r,
                                        "cpu_us": 1e6 * cpu / args.picker_streams,
                                        "streams_per_s": args.picker_streams / wall,
                                        "alone_ms": {"p50": to_ms(percentile(sorted(alone), 50)),
                                                     "p99": to_ms(percentile(sorted(alone), 99))}})
                            log(f"   round {r} {label:<30} {messages} messages {out[-1]['cpu_us']:>6.0f} µs CPU "
                                f"per stream, {out[-1]['streams_per_s']:,.0f} streams/s; one at a time "
                                f"{out[-1]['alone_ms']['p50']} ms p50")
            finally:
                await picker.stop()
                await null.stop(0)
                threads.stop(0)
        finally:
            for c in children:
                c.stop()
    return out


# -- (d) hit rate on the mixed workload ------------------------------------------------------------------------------
HIT_CONTENDERS = ["serve", "envoy+epp", "envoy"]


async def hit_rate_run(label: str, plan: Any, workload: Any, sizing: Any, args: argparse.Namespace,
                       logs: Path) -> dict[str, Any]:
    """Fresh emulated engines (cold caches, compare_peers' sizing) and a fresh router; the workload through it."""
    from warmroute.bench.loadgen import run_bench

    port = free_ports(cp.INSTANCES)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(cp.INSTANCES)]
    engines = Child(f"hit-engines-{_name(label)}", cp.engine_argv(port, sizing.kv_capacity_tokens, plan.time_scale,
                                                                  plan.max_running), logs)
    running = Running(sat.FleetSpec("engine"), [engines], urls, {})
    try:
        await engines.wait_for_log("listening on", cp.INSTANCES, timeout_s=60)
        stack = await start_stack(running, label, free_ports(4, port + cp.INSTANCES), sizing.kv_capacity_tokens,
                                  logs, "hit")
        model = await engines.wait_for_model(urls[0])
        window = argparse.Namespace(**{**vars(args), "duration": args.hit_duration, "warmup": 5.0})
        result = await run_bench(stack.url, workload, cp.bench_settings(plan, window, model, urls, label))
        summary = result.summary()
    finally:
        running.stop()
    return {"contender": label, "hit_rate": summary["hit_rate"], "ttft_ms": summary["ttft_ms"],
            "requests": summary["requests"], "errors": summary["errors"],
            "load_spread": summary["instances"]["load_spread"]}


async def phase_hit_rate(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    plan = cp.plans(quick=True)[0]
    assert plan.label == "mixed"
    workload = plan.build(args.seed, cp.MAX_TOKENS)
    sizing = cp.size(plan, workload)
    log(f"== (d) hit rate, the mixed workload ({plan.description}), {args.hit_duration:g} s per run")
    out = []
    for r in range(args.hit_rounds):
        for label in (HIT_CONTENDERS if r % 2 == 0 else list(reversed(HIT_CONTENDERS))):
            res = await hit_rate_run(label, plan, workload, sizing, args, logs)
            res["round"] = r
            out.append(res)
            log(f"   round {r} {label:<10} fleet hit rate {res['hit_rate']['fleet']}  requests {res['requests']}")
    return out


# -- summaries ------------------------------------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def _by_contender(windows: list[dict[str, Any]], labels: Sequence[str] = CONTENDERS) -> Iterator[tuple[str, list]]:
    """(label, its windows) for each of `labels` that has any, in that order."""
    for label in labels:
        mine = [w for w in windows if w["contender"] == label]
        if mine:
            yield label, mine


def saturation_rows(windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for label, mine in _by_contender(windows):
        parts = sorted({k.split("/", 1)[1] for w in mine for k in w["cpu_cores"] if k.startswith(label + "/")})
        cores = {p: _median([w["cpu_cores"].get(f"{label}/{p}", 0.0) for w in mine]) for p in parts}
        rps = _median([w["rps"] for w in mine])
        per_request = {p: _median([1e6 * w["cpu_cores"].get(f"{label}/{p}", 0.0) / w["rps"] for w in mine if w["rps"]])
                       for p in parts}
        rows.append({"label": label, "rps": rps, "rounds": [w["rps"] for w in mine],
                     "errors": sum(sum(w["errors"].values()) for w in mine),
                     "latency_p50": _median([w["latency_ms"]["p50"] for w in mine]),
                     "latency_p99": _median([w["latency_ms"]["p99"] for w in mine]),
                     "cores": cores, "cpu_us": per_request,
                     "instances": _median([w["cpu_cores"]["instances"] for w in mine]),
                     "loadgen": _median([w["cpu_cores"]["load generator"] for w in mine]),
                     "other": _median([w["cpu_cores"]["other processes"] for w in mine])})
    return rows


def latency_rows(windows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for label, mine in _by_contender(windows):
        pairs = [p for w in mine for p in w["pairs"]]
        s = sat.latency_summary(pairs)
        per_round = [sat.latency_summary(w["pairs"]) for w in mine]
        rows.append({"label": label, "pairs": len(pairs), "errors": sum(sum(w["errors"].values()) for w in mine),
                     **s, "added_p50_rounds": [r["added_p50"] for r in per_round],
                     "added_p99_rounds": [r["added_p99"] for r in per_round]})
    return rows


# Each section of the report: its title, what it measured, its table's columns and their alignment.
SECTIONS = {
    "saturation": (
        "(a) Saturation throughput: 4 trivial instances (warmroute.bench.trivial) in 1 process",
        "Closed loop, 128 keep-alive connections, chat completions of ≈293 characters, max_tokens 8, every other one "
        "streamed. req/s: median over the rounds (each round in brackets). CPU per request: the process's cores ÷ "
        "req/s (medians over the rounds), for Envoy and the picker separately.",
        ["contender", "req/s (rounds)", "errors", "latency p50 / p99", "cores", "CPU per request",
         "instances / load gen / other cores"], "lrrrllr"),
    "latency": (
        "(b) Added time to first token at 64 concurrent streams",
        "4 trivial instances, tokens 20 ms apart, 32 tokens; 64 sessions each sending the same streamed request "
        "straight to an instance and through the router at the same moment. Added = routed percentile − direct "
        "percentile (pairs pooled over the rounds).",
        ["router", "pairs", "errors", "direct TTFT p50 / p99", "routed TTFT p50 / p99", "**added p50 / p99**",
         "added p50 per round"], "lrrrrrl"),
    "picker": (
        "(c) Where the picker's time goes",
        "The same ext_proc streams (request headers, buffered body of a chat completion, response headers, one "
        "response body chunk with the usage; or their first 3 or 2 messages) from a gRPC client in another "
        "process, 32 at a time, answered by a null ext_proc service (an empty answer to each message: grpcio's "
        "own cost) on grpcio's asyncio API and on its sync API (a thread per stream), and by `warmroute epp` (4 "
        "stub instances); CPU of the serving process per stream, median of the rounds. One at a time: the p50 "
        f"time from a stream's first message to its last answer, {LONE_STREAMS} streams one after another (the "
        "latency the service adds on an idle path).",
        ["service", "messages each way", "CPU per stream (rounds)", "one at a time p50 (rounds)", "streams/s"],
        "llrrr"),
    "hits": (
        "(d) Hit rate on the mixed workload",
        "benchmarks/compare_peers.py's `mixed` plan (45% shared system prompts, 25% RAG, 25% multi-turn chats, 5% "
        "one hot prompt; 16 sessions in a closed loop, KV capacity 0.6 × the working set over 4 emulated engines): "
        "fresh engines and a fresh router per run; fleet token hit rate from the engines' /metrics over the "
        "measured window. `envoy` (round robin, no picker) is the prefix-blind baseline.",
        ["router", "fleet hit rate (runs)", "client hit rate", "TTFT p50 / p99", "requests", "errors"], "lrrrrr"),
}


def render(meta: dict[str, Any], sat_rows: list[dict[str, Any]], lat_rows: list[dict[str, Any]],
           picker: list[dict[str, Any]], hits: list[dict[str, Any]]) -> str:
    out = [f"## {SECTION}", "", "Regenerated by (do not edit by hand):", "", f"    {meta['command']}", "",
           f"Run {meta['started']} on {meta['cores']} CPU cores shared with other work (load average before "
           f"{meta['load_before']}, after {meta['load_after']}); Envoy {meta['envoy'][0]} with one worker thread; "
           f"{meta['rounds']} rounds, {meta['warmup']} s warm-up + {meta['duration']} s measured per window, ABBA "
           f"order. Code: {meta['tree']}.", ""]
    tables = {
        "saturation": [_saturation_cells(r) for r in sat_rows],
        "latency": [_latency_cells(r) for r in lat_rows],
        "picker": [_picker_cells(label, messages, [w for w in mine if w.get("messages", 4) == messages])
                   for messages in STREAM_SHAPES for label, mine in _by_contender(picker, SERVICES)
                   if any(w.get("messages", 4) == messages for w in mine)],
        "hits": [_hit_cells(label, mine) for label, mine in _by_contender(hits, HIT_CONTENDERS)],
    }
    for name, rows in tables.items():
        if rows:
            title, text, header, align = SECTIONS[name]
            out += [f"### {title}", "", text, "", *markdown_table(header, align, rows), ""]
    return "\n".join(out)


def _saturation_cells(r: dict[str, Any]) -> list[str]:
    rounds = ", ".join(f"{x:,.0f}" for x in r["rounds"])
    cores = ", ".join(f"{p} {v:.2f}" for p, v in r["cores"].items()) or "-"
    cpu = ", ".join(f"{p} {v:.0f} µs" for p, v in r["cpu_us"].items() if v is not None) or "-"
    return [r["label"], f"{r['rps']:,.0f} ({rounds})", str(r["errors"]), f"{r['latency_p50']} / {r['latency_p99']} ms",
            cores, cpu, f"{r['instances']:.2f} / {r['loadgen']:.2f} / {r['other']:.2f}"]


def _latency_cells(r: dict[str, Any]) -> list[str]:
    rounds = ", ".join(f"{x:.2f}" for x in r["added_p50_rounds"])
    return [r["label"], f"{r['pairs']:,}", str(r["errors"]), f"{r['direct_p50']} / {r['direct_p99']} ms",
            f"{r['router_p50']} / {r['router_p99']} ms", f"**{r['added_p50']} / {r['added_p99']} ms**", rounds]


def _picker_cells(label: str, messages: int, mine: list[dict[str, Any]]) -> list[str]:
    rounds = ", ".join(f"{w['cpu_us']:.0f}" for w in mine)
    alone = ", ".join(f"{w['alone_ms']['p50']}" for w in mine)
    return [label, f"{messages}: {STREAM_SHAPES[messages]}", f"{_median([w['cpu_us'] for w in mine]):.0f} µs ({rounds})",
            f"{_median([w['alone_ms']['p50'] for w in mine])} ms ({alone})",
            f"{_median([w['streams_per_s'] for w in mine]):,.0f}"]


def _hit_cells(label: str, mine: list[dict[str, Any]]) -> list[str]:
    fleet = [h["hit_rate"]["fleet"] for h in mine]
    runs = ", ".join(pct(x) for x in fleet if x is not None)
    errors = sum(sum(h["errors"].values()) if isinstance(h["errors"], dict) else h["errors"] for h in mine)
    return [label, f"{pct(_median(fleet) or 0)} ({runs})", pct(_median([h["hit_rate"]["client"] for h in mine])),
            f"{_median([h['ttft_ms']['p50'] for h in mine])} / {_median([h['ttft_ms']['p99'] for h in mine])} ms",
            f"{sum(h['requests'] for h in mine):,}", str(errors)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--connections", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=32)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    p.add_argument("--peers-venv", type=Path, default=cp.PEERS_VENV, help="the virtualenv with smg")
    p.add_argument("--picker-streams", type=int, default=3000)
    p.add_argument("--hit-rounds", type=int, default=1, help="runs of each router on the mixed workload")
    p.add_argument("--hit-duration", type=float, default=30.0, help="measured seconds of each hit-rate run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phases", nargs="+", default=["saturation", "latency", "picker", "hits"],
                   choices=["saturation", "latency", "picker", "hits"])
    return p.parse_args(argv)


async def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import os
    import subprocess

    from warmroute.gateway.envoy import envoy_binary

    version = subprocess.run([envoy_binary() or "envoy", "--version"], capture_output=True, text=True).stdout
    meta = {"command": command_line(__file__, argv), "started": now_utc(), "cores": os.cpu_count(),
            "load_before": load_average(), "envoy": version.partition("version:")[2].strip().split("/")[1:2] or ["?"],
            "rounds": args.rounds, "warmup": args.warmup, "duration": args.duration, "tree": tree_state()}
    with tempfile.TemporaryDirectory(prefix="warmroute-gateway-bench-") as tmp:
        logs = Path(tmp)
        sat_windows = await phase_saturation(args, logs) if "saturation" in args.phases else []
        lat_windows = await phase_latency(args, logs) if "latency" in args.phases else []
        picker = await phase_picker(args) if "picker" in args.phases else []
        hits = await phase_hit_rate(args, logs) if "hits" in args.phases else []
    meta["load_after"] = load_average()
    return {"meta": meta, "saturation": sat_windows, "latency": lat_windows, "picker": picker, "hits": hits}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = asyncio.run(measure(args, argv))
    section = render(result["meta"], saturation_rows(result["saturation"]), latency_rows(result["latency"]),
                     result["picker"], result["hits"])
    print(section)
    write_outputs(OUT / "gateway.json", result, section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
