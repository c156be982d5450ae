"""The `warmroute` command: one subcommand per job, each defined in its own module.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported only when
chosen, so `warmroute engine` does not pay for matplotlib and `warmroute serve` does not pay for numpy plots.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from warmroute.errors import UsageError

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("warmroute.router.cli", "run the prefix-aware routing proxy"),
    "epp": ("warmroute.gateway.cli", "run as the endpoint picker of an Envoy gateway (ext_proc, Gateway API "
                                     "Inference Extension)"),
    "engine": ("warmroute.engine.cli", "run emulated OpenAI-compatible inference instances"),
    "bench": ("warmroute.bench.cli", "drive a workload through an endpoint and report TTFT, throughput, hit rate"),
    "demo": ("warmroute.bench.demo", "start a local emulated fleet and compare routing strategies on it"),
    "simulate": ("warmroute.sim.cli", "simulate a fleet in virtual time and compare strategies"),
    "fleet": ("warmroute.realengine.fleet_cli", "start a local fleet of real vLLM instances on this machine's CPUs"),
    "make-tiny-model": ("warmroute.realengine.cli", "write a tiny random-weight model (GGUF for llama.cpp, HF for vLLM)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmroute", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # import only the module that will run
            _load(module).add_arguments(p)
    return parser


def _load(module: str):
    return importlib.import_module(module)


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args()
    if not args.command:
        parser.print_help()
        return 2
    try:
        return int(_load(SUBCOMMANDS[args.command][0]).run(args) or 0)
    except UsageError as exc:
        print(f"warmroute {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
