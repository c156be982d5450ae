"""`warmroute engine`: serve K emulated OpenAI-compatible instances from one process, on ports P..P+K-1."""

from __future__ import annotations

import argparse
import asyncio
import signal

from warmroute.engine.kv_transfer import FAILURE_POLICIES, MODES, TransferConfig
from warmroute.engine.model import EngineConfig
from warmroute.engine.profiles import PROFILES
from warmroute.engine.server import DEFAULT_MODEL, Fleet, start_fleet
from warmroute.engine.tokenizer import PromptTokenizer, TokenizerError, load_tokenizer
from warmroute.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port of the first instance; 0: any free ports (default %(default)s)")
    parser.add_argument("--count", type=int, default=1, metavar="K", help="instances, on consecutive ports")
    parser.add_argument("--name", help="instance name (with --count K: prefix of NAME-0..; default engine-i)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name served (default %(default)s)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="model directory whose tokenizer.json and tokenizer_config.json (chat template) the "
                             "engine tokenizes with (default: the tiny model's, as make-tiny-model --format hf "
                             "writes it)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="8b",
                        help="hardware calibration: " + "; ".join(f"{p.name}: {p.description}"
                                                                 for p in PROFILES.values()))
    parser.add_argument("--kv-capacity-tokens", type=int, help="KV cache size in tokens (default: the profile's)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    parser.add_argument("--prefill-tokens-per-s", type=float, help="override the profile's prefill rate")
    parser.add_argument("--itl-ms", type=float, help="override the profile's batch-1 inter-token latency")
    parser.add_argument("--max-running", type=int, default=256, help="largest running batch (default %(default)s)")
    parser.add_argument("--max-batched-tokens", type=int, default=8192,
                        help="tokens computed per step, decode and prefill chunks (default %(default)s)")
    parser.add_argument("--kv-events-port", type=int, metavar="P",
                        help="publish KV-cache events as vLLM does (ZMQ on HOST:P+2i for instance i, replay on "
                             "P+2i+1; needs pyzmq and msgspec); default: none")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="real seconds per modelled second: 0.1 runs ten times faster (default %(default)s)")
    pd = parser.add_argument_group(
        "disaggregated prefill/decode", "--kv-transfer nixl: as vLLM with NixlConnector (kv_both): a request whose "
        "kv_transfer_params say do_remote_decode is prefilled and its answer's kv_transfer_params name the blocks "
        "kept for the decode instance; one whose kv_transfer_params say do_remote_prefill reads them from there "
        "(side channel: POST /kv_transfer/read on the instance's HTTP port) and decodes. --kv-transfer bootstrap: "
        "as SGLang, with fixed roles (--pd-role); both legs carry bootstrap_host, bootstrap_port, bootstrap_room")
    pd.add_argument("--kv-transfer", choices=MODES, help="take legs of disaggregated prefill/decode (default: none)")
    pd.add_argument("--pd-role", choices=("prefill", "decode"),
                    help="with --kv-transfer bootstrap: the instances' role (SGLang's --disaggregation-mode)")
    pd.add_argument("--transfer-tokens-per-s", type=float, default=200_000.0,
                    help="prompt tokens of KV a decode instance reads per modelled second (default %(default)s)")
    pd.add_argument("--kv-lease-s", type=float, default=30.0,
                    help="nixl: real seconds a prefill keeps unread blocks (vLLM's kv_lease_duration; a waiting "
                         "decode instance renews it) (default %(default)s)")
    pd.add_argument("--kv-load-failure-policy", choices=FAILURE_POLICIES, default="fail",
                    help="nixl: a decode leg whose remote instance cannot be read fails with HTTP 500 (vLLM's "
                         "default) or computes its prompt here (default %(default)s)")
    pd.add_argument("--bootstrap-timeout-s", type=float, default=300.0,
                    help="bootstrap: real seconds a prefill waits for its decode instance and a decode instance for "
                         "its KV before the request fails (SGLang's default %(default)s)")
    pd.add_argument("--bootstrap-port", type=int, metavar="B",
                    help="bootstrap: instance i also serves its side channel on B+i, the bootstrap_port the "
                         "router sends (default: its HTTP port)")


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.count < 1:
        raise UsageError("--count must be at least 1")
    if not 0 <= args.port <= 65536 - args.count:
        raise UsageError(f"--port must leave room for {args.count} consecutive ports below 65536")
    if args.time_scale < 0:
        raise UsageError("--time-scale must be >= 0")
    if args.kv_events_port is not None and not 1 <= args.kv_events_port <= 65536 - 2 * args.count:
        raise UsageError(f"--kv-events-port must leave room for {2 * args.count} consecutive ports below 65536")
    if args.bootstrap_port is not None and not 1 <= args.bootstrap_port <= 65536 - args.count:
        raise UsageError(f"--bootstrap-port must leave room for {args.count} consecutive ports below 65536")
    kv_transfer = _kv_transfer(args)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except TokenizerError as exc:
        raise UsageError(str(exc)) from None
    with _event_loop_runner() as runner:
        return runner.run(_serve(args, config, tokenizer, kv_transfer))


def _config(args: argparse.Namespace) -> EngineConfig:
    if args.prefill_tokens_per_s is not None and args.prefill_tokens_per_s <= 0:
        raise UsageError("--prefill-tokens-per-s must be positive")
    if args.itl_ms is not None and args.itl_ms < 0:
        raise UsageError("--itl-ms must be >= 0")
    try:
        return EngineConfig.from_profile(
            args.profile, kv_capacity_tokens=args.kv_capacity_tokens, prefill_tokens_per_s=args.prefill_tokens_per_s,
            itl_ms=args.itl_ms, block_size=args.block_size, max_running=args.max_running,
            max_batched_tokens=args.max_batched_tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _kv_transfer(args: argparse.Namespace) -> TransferConfig | None:
    if args.kv_transfer is None:
        if args.pd_role is not None or args.bootstrap_port is not None:
            raise UsageError("--pd-role and --bootstrap-port go with --kv-transfer bootstrap")
        return None
    if (args.kv_transfer == "bootstrap") != (args.pd_role is not None):
        raise UsageError("--kv-transfer bootstrap needs --pd-role (prefill or decode); nixl takes none")
    if args.bootstrap_port is not None and args.kv_transfer != "bootstrap":
        raise UsageError("--bootstrap-port goes with --kv-transfer bootstrap")
    try:
        return TransferConfig(
            args.kv_transfer, role=args.pd_role or "both", transfer_tokens_per_s=args.transfer_tokens_per_s,
            kv_bytes_per_token=int(PROFILES[args.profile].kv_kib_per_token * 1024), lease_s=args.kv_lease_s,
            failure_policy=args.kv_load_failure_policy, bootstrap_timeout_s=args.bootstrap_timeout_s)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


async def _serve(args: argparse.Namespace, config: EngineConfig, tokenizer: PromptTokenizer,
                 kv_transfer: TransferConfig | None) -> int:
    try:
        fleet: Fleet = await start_fleet(args.count, args.port, host=args.host, config=config, tokenizer=tokenizer,
                                         name=args.name, model_name=args.model, time_scale=args.time_scale,
                                         kv_events_port=args.kv_events_port, kv_transfer=kv_transfer,
                                         bootstrap_port=args.bootstrap_port)
    except OSError as exc:
        raise UsageError(f"cannot listen on {args.host}: {exc}") from None
    for server in fleet.servers:
        events = "" if server.kv_events is None else (f", KV events on {server.kv_events.endpoint} (replay "
                                                      f"{server.kv_events.replay_endpoint})")
        if server.kv_transfer is not None:
            kvt = server.kv_transfer
            events += (f", KV transfer {kvt.config.mode} as {kvt.config.role} (engine id {kvt.engine_id}, side "
                       f"channel port {server.bootstrap_port})")
        print(f"{server.name} listening on {server.url}{events}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await fleet.close()
    return 0


def _event_loop_runner() -> asyncio.Runner:
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)
