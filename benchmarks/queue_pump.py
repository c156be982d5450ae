#!/usr/bin/env python3
"""Placement's CPU per freed slot with the router's queue full (issue #33): N requests waiting, slots freed one at
a time on a fleet whose engines are all full (warmroute.bench.full_queue).

    .venv/bin/python benchmarks/queue_pump.py [--waiting 256 1024 4096] [--tenants 1 4] [--slots 256]

Prints, per queue size and tenant count, the milliseconds of CPU a freed slot costs the router's event loop (the
queue's pump: placement's choice and the books), the mean over --slots freed slots.
"""

from __future__ import annotations

import argparse
import sys
import time

from warmroute.bench.full_queue import free_slots, full_queue


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waiting", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--tenants", type=int, nargs="+", default=[1, 4])
    p.add_argument("--slots", type=int, default=256)
    args = p.parse_args(argv)
    for tenants in args.tenants:
        for waiting in args.waiting:
            adm = full_queue(waiting, tenants)
            start = time.process_time()
            taken = free_slots(adm, args.slots, 10.0)
            ms = (time.process_time() - start) * 1e3 / args.slots
            print(f"waiting {waiting:5d}, tenants {tenants}: {ms:.3f} ms of CPU per freed slot ({taken} assigned)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
