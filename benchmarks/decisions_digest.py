#!/usr/bin/env python3
"""A digest of every per-request decision (instance, reason, first token, cached tokens) the simulator makes on
the documented cases, per strategy: run it before and after a change to the routing code and diff the output.

    .venv/bin/python benchmarks/decisions_digest.py > after.txt; diff before.txt after.txt
"""

from __future__ import annotations

import argparse
import hashlib
from collections import Counter

from warmroute.bench.cli import workload_from_args
from warmroute.sim import cli
from warmroute.sim.simulator import Simulation

CASES = {  # the simulator commands of docs/benchmarks.md (the 'mixed-tight' one puts the guards to work)
    "mixed": "--workload mixed --instances 4 --kv-capacity-tokens 30000 --max-running 32 --rate 12 --requests 3000",
    "hot": "--workload hot --instances 4 --kv-capacity-tokens 30000 --max-running 32 --rate 32 --requests 4000",
    "chat": "--workload chat --param min_turns=6 --param max_turns=12 --param reply_tokens=300 --max-tokens 2 "
            "--instances 4 --kv-capacity-tokens 13312 --max-running 8 --concurrency 32 --requests 3000",
    "hot06": "--workload hot --param hot=0.6 --instances 4 --kv-capacity-tokens 10240 --max-running 8 --max-tokens 2 "
             "--rate 25 --requests 3000",
    "shared-scale": "--workload shared --instances 7 --rate 4 --requests 3000 --kv-capacity-tokens 60000 "
                    "--scale-at 400:+1 --scale-at 700:-1",
    "mixed-tight": "--workload mixed --instances 4 --kv-capacity-tokens 30000 --max-running 32 --rate 12 "
                   "--requests 1500 --prefix-length 1024 --concurrency-threshold 4 --balance-factor 0.5",
}
STRATEGIES = ("cache_aware", "oracle", "prefix", "session", "least_loaded", "round_robin", "random", "sglang_like")


def main() -> None:
    for case, argv in CASES.items():
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        args = parser.parse_args(argv.split())
        workload = workload_from_args(args)
        settings = cli.settings_from_args(args, workload)
        for strategy in STRATEGIES:
            records = Simulation(settings, workload, strategy).run().records
            digest = hashlib.sha256(repr([(r.instance, r.reason, r.first_token, r.cached_tokens)
                                          for r in records]).encode()).hexdigest()[:16]
            print(case, strategy, digest, dict(sorted(Counter(r.reason for r in records).items())), flush=True)


if __name__ == "__main__":
    main()
