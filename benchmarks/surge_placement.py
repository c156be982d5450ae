"""overload.py's 2x surge in the simulator, cache_aware at its defaults beside the simulator's model of SGLang's
policy: when the router sent requests (per second, first 30 s), the engines' hit rate per request class, and on
how many instances each RAG document and shared system prompt was computed during the surge, with the engines'
limits as the router learned them.

A diagnostic for issue #32 (why cache_aware's hit rate falls behind under saturation), not a scored benchmark:

    python benchmarks/surge_placement.py [--seed N]

It records each request's prompt prefix (its first PREFIX_CHARS characters: past a RAG request's system prompt,
into its document) by overriding the simulator's send step."""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overload  # noqa: E402  (the surge's fleet, workload and phases)

from warmroute.sim.simulator import Simulation  # noqa: E402

PREFIX_CHARS = 3000
CLASSES = ("rag", "shared")


class Traced(Simulation):
    """The simulation, noting (time, class, prefix, instance) of every request sent whole."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.sends: list[tuple[float, str, int, str]] = []

    def _send(self, now, arrival, life, d) -> None:  # type: ignore[no-untyped-def]
        self.sends.append((now, life.shell[0].tag, life.key.prefix_hash(PREFIX_CHARS), d.instance))
        super()._send(now, arrival, life, d)


def run(args: argparse.Namespace, strategy: str, admission: bool) -> None:
    s = overload.sim_surge_settings(args, admission, args.capacity).changed("timeout_s", 60.0)  # the default
    sim = Traced(s, overload.mixed(args.seed), strategy)
    res = sim.run()
    per_s = collections.Counter(int(t) for t, *_ in sim.sends if t < 30)
    missed, total = collections.Counter(), collections.Counter()
    for x in res.records:
        if 5.0 <= x.arrival < args.high and x.first_token is not None:
            missed[x.tag] += x.prompt_tokens - x.cached_tokens
            total[x.tag] += x.prompt_tokens
    print(strategy, f"hit rate {res.hit_rate:.4f}")
    print("  sent per second, 0-29 s:", [per_s.get(k, 0) for k in range(30)])
    print("  hit rate by class, 5 s to the surge's end:",
          json.dumps({t: round(1 - missed[t] / total[t], 3) for t in sorted(total)}))
    for tag in CLASSES:
        pairs = {(h, i) for t, tag_, h, i in sim.sends if tag_ == tag and t < args.high}
        prefixes = {h for h, _ in pairs}
        print(f"  {tag}: {len(prefixes)} prefixes on {len(pairs)} (prefix, instance) pairs by the surge's end, "
              f"{len(pairs) / max(1, len(prefixes)):.2f} instances each")
    if admission:
        print("  learned engine limits at the end:",
              {n: i.capacity.learned for n, i in sim.fleet.instances.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capacity", type=float, default=73.5, help="req/s the surge doubles (overload.py sim-surge's)")
    mine = p.parse_args()
    args = overload.parse_args(["sim-surge", "--capacity", str(mine.capacity), "--seed", str(mine.seed)])
    run(args, "cache_aware", True)
    run(args, "sglang_like", False)


if __name__ == "__main__":
    main()
