#!/usr/bin/env python3
"""The router's liveness with its queue full (issue #33): N requests waiting, nothing completing.

    .venv/bin/python benchmarks/queue_livez.py [--waiting 4096] [--probes 40]

One trivial instance behind `warmroute serve --engine-capacity 1`: one streamed request holds the engine's only
slot for the whole run (a token every 10 s), N more wait in the router's queue (its default bound is 4,096); then
/livez is asked --probes times, one after another (warmroute.bench.stream_load.livez_with_queue). Prints /livez
latency p50 / p99 / max and the router's CPU, in cores, over that window.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from warmroute.bench import stream_load
from warmroute.bench.stats import percentile


async def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waiting", type=int, default=4096)
    p.add_argument("--probes", type=int, default=40)
    args = p.parse_args(argv)
    stream_load.raise_fd_limit(2 * args.waiting + 200)
    stack = await stream_load.start_stack(10_000, "--engine-capacity", "1", "--queue-timeout", "600",
                                          "--queue-max-requests", str(max(4096, args.waiting)), admission=True)
    try:
        got = await stream_load.livez_with_queue(stack, args.waiting, args.probes)
    finally:
        await stack.close()
    took = got.livez_ms
    print(f"waiting {got.waiting}: /livez p50 {percentile(took, 50):.1f} ms, p99 {percentile(took, 99):.1f} ms, "
          f"max {max(took):.1f} ms over {len(took)} probes; router CPU {got.router_cores:.2f} of a core while "
          "nothing completes")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
