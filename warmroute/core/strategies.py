"""Routing strategies: given a routing key and the fleet, choose an instance. This is where decisions are made.

Every strategy is a small class with one method, `choose(key, fleet) -> Decision`, doing no I/O, so the HTTP
router and the simulator make exactly the same decision for the same state.

  cache_aware  (default) lowest estimated time to first token, from the prefix index and queued prefill,
               under a bounded-load guard; ties and cold prefixes placed by rendezvous on the prefix.
  prefix       the reference's behaviour: rendezvous on the first PrefixLength characters, spilling along
               that prefix's own rendezvous order past ConcurrencyThreshold.
  session      rendezvous on the session id (x-session-id header or `user` field).
  least_loaded, round_robin, random   the baselines.
"""

from __future__ import annotations

import math
import random as _random
from dataclasses import dataclass

from warmroute.core import rendezvous
from warmroute.core.engine_load import backlog_tokens, foreign_requests
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.routing_key import RoutingKey

# Decision reasons (also the label values of the decisions metric).
CACHE_HIT = "cache_hit"  # chosen for the prefix it already holds
COLD = "cold"  # nobody holds the prefix: placed by rendezvous hashing
OVERLOAD_SPILL = "overload_spill"  # the preferred instance was too busy: sent elsewhere
UNHEALTHY_FALLBACK = "unhealthy_fallback"  # the preferred instance is down or draining
LOAD_BALANCE = "load_balance"  # a load-only strategy chose (least_loaded, round_robin, random)
AFFINITY = "affinity"  # the prefix's or session's own instance (prefix, session)
REASONS = (CACHE_HIT, COLD, OVERLOAD_SPILL, UNHEALTHY_FALLBACK, LOAD_BALANCE, AFFINITY)


class NoInstanceAvailable(Exception):
    """No healthy instance to route to (the shell answers 503)."""


class ModelNotServed(NoInstanceAvailable):
    """Healthy instances exist, but none of those that serve the request's model is one of them."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no healthy instance serves model {model!r}")
        self.model = model


@dataclass(frozen=True)
class Decision:
    instance: str
    reason: str
    matched_tokens: int = 0  # tokens of the prompt the chosen instance is predicted to hold
    prompt_tokens: int = 0
    blocks: tuple[int, ...] | list[int] = ()  # the chain to record for the chosen instance

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.matched_tokens)

    @property
    def matched_ratio(self) -> float:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(kw_only=True)  # keywords only: a positional call silently shifts when a field is added
class StrategySettings:
    prefix_length: int = 4096  # characters (bytes for /invocations), 1,024..65,536 as in the reference
    concurrency_threshold: int = 32  # in-flight requests, 1..1,024 as in the reference
    # cache_aware's guard: no instance above (1+ε) x the mean in-flight plus a slack of requests. The cost
    # model already steers away from queues, so the guard only stops pile-ups; tighter values (ε 0.25, slack
    # 2) forced hot-prefix requests onto cold instances and about doubled p99 TTFT in the simulator
    # (benchmarks/cache_aware_tuning.py, docs/benchmarks.md).
    balance_factor: float = 1.0  # ε
    balance_slack: int = 4
    cold_to_least_loaded: bool = True
    # α: cost of an uncached token relative to a queued one, by who holds the prefix (see CacheAwareStrategy)
    miss_weight: float = 16.0  # one instance holds its deepest match: a private prefix (a conversation)
    shared_miss_weight: float = 1.0  # several do (a popular prefix), or none does
    block_bytes: int = 64


def _least_loaded(instances: list[Instance]) -> Instance:
    return min(instances, key=lambda i: (i.inflight, i.queued_prefill_tokens, i.name))


def _guard_loads(up: list[Instance]) -> list[float]:
    """In-flight requests per instance as the load guard counts them: other routers' requests too, where the
    engine reports them."""
    return [i.inflight if i.engine is None else i.inflight + foreign_requests(i.engine) for i in up]


def _under_cap(up: list[Instance], loads: list[float], cap: int) -> list[Instance]:
    """The instances whose load is under the guard's cap, in order."""
    if max(loads) < cap:  # the usual case, no copy (a non-NaN max under the cap bounds every load)
        return up
    return [i for i, n in zip(up, loads) if not n >= cap]


def _routable(fleet: Fleet, model: str | None = None) -> list[Instance]:
    up = fleet.routable(model)
    if not up:
        if model is not None and fleet.routable():  # healthy instances exist, but not for this model
            raise ModelNotServed(model)
        raise NoInstanceAvailable("no healthy instance")
    return up


class Strategy:
    name = "base"
    records_prefixes = False  # whether choices feed the prefix index

    def __init__(self, settings: StrategySettings | None = None, seed: int | None = None) -> None:
        self.settings = settings or StrategySettings()

    def choose(self, key: RoutingKey, fleet: Fleet) -> Decision:
        raise NotImplementedError

    def _plain(self, inst: Instance, key: RoutingKey, reason: str) -> Decision:
        return Decision(inst.name, reason, 0, key.tokens)


class RandomStrategy(Strategy):
    name = "random"

    def __init__(self, settings: StrategySettings | None = None, seed: int | None = None) -> None:
        super().__init__(settings)
        self._rng = _random.Random(seed)

    def choose(self, key: RoutingKey, fleet: Fleet) -> Decision:
        return self._plain(self._rng.choice(_routable(fleet, key.model)), key, LOAD_BALANCE)


class RoundRobinStrategy(Strategy):
    name = "round_robin"

    def __init__(self, settings: StrategySettings | None = None, seed: int | None = None) -> None:
        super().__init__(settings)
        self._next = 0

    def choose(self, key: RoutingKey, fleet: Fleet) -> Decision:
        up = sorted(_routable(fleet, key.model), key=lambda i: i.name)
        self._next += 1
        return self._plain(up[self._next % len(up)], key, LOAD_BALANCE)


class LeastLoadedStrategy(Strategy):
    name = "least_loaded"

    def choose(self, key: RoutingKey, fleet: Fleet) -> Decision:
        return self._plain(_least_loaded(_routable(fleet, key.model)), key, LOAD_BALANCE)


def _affinity_choice(hash_key: int, fleet: Fleet, threshold: int, model: str | None) -> tuple[Instance, str]:
    """Rendezvous order of `hash_key` over the instances that may serve `model`: its first instance under the
    threshold, else the least loaded."""
    serving = fleet.serving(model) if model is not None else None
    names = rendezvous.order(hash_key, list(fleet.instances) if serving is None else sorted(serving))
    preferred_up = True
    for pos, name in enumerate(names):
        inst = fleet.instances[name]
        if not inst.routable:
            preferred_up = preferred_up and pos > 0
            continue
        if inst.inflight < threshold:
            if pos == 0:
                return inst, AFFINITY
            return inst, (UNHEALTHY_FALLBACK if not preferred_up else OVERLOAD_SPILL)
    return _least_loaded(_routable(fleet, model)), OVERLOAD_SPILL


class PrefixStrategy(Strategy):
    """Parity with the reference: the first PrefixLength characters pick the instance."""

    name = "prefix"

    def choose(self, key: RoutingKey, fleet: Fleet) -> Decision:
        _routable(fleet, key.model)
        inst, reason = _affinity_choice(key.prefix_hash(self.settings.prefix_length), fleet,
                                        self.settings.concurrency_threshold, key.model)
        return self._plain(inst, key, reason)


class SessionStrategy(Strategy):
    """Sticky sessions: one conversation, one instance. Requests without a session fall back to prefix."""

    name = "session"

    def choose(self, key: RoutingKey, fleet: Fleet) -> Decision:
        _routable(fleet, key.model)
        h = (hash_text(key.session) if key.session else key.prefix_hash(self.settings.prefix_length))
        inst, reason = _affinity_choice(h, fleet, self.settings.concurrency_threshold, key.model)
        return self._plain(inst, key, reason)


def hash_text(text: str) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


class CacheAwareStrategy(Strategy):
    """Lowest estimated time to first token, never at the cost of drowning an instance.

    For every routable instance under the guard (in-flight < ConcurrencyThreshold and below
    (1+ε) x mean + slack):
        cost = (prefill tokens already queued there + α x this request's tokens not cached there) / rate
    The cheapest wins. α weighs a cache miss against queueing, and depends on who holds the prefix:
      * one instance holds the deepest match (a conversation's history, a document being asked about):
        α = 16. Sending the request elsewhere recomputes all of it and strands the only warm copy, and
        every later turn pays again; kept on its instance, a conversation's blocks are the freshest there
        and survive until its next turn. (With α = 2 for everything, long multi-turn chats moved between
        instances and hit 31-42% where sticky routing hits 55-65%; docs/benchmarks.md.)
      * several instances hold it (a popular system prompt), or none: α = 1, this request's own time to
        first token. One more copy of a prefix already proven popular is an investment that spreads its
        load; α = 2 here pinned a hot prompt to a few instances (request counts 1.6x the mean).
    Instances within one block of the cheapest tie: the less loaded of them, then the highest in the prefix's
    rendezvous order, so cold prefixes land where other router replicas would put them, and a hot prefix warms
    a small, stable set of instances instead of one (the guard makes it spill) or all of them. Where the engines
    report their own load (scraped /metrics), what other routers sent there counts as in flight and as queued
    prefill too (core/engine_load.py); without such reports the rule is exactly the above.
    """

    name = "cache_aware"
    records_prefixes = True

    # How the rule is computed (the rule itself is in the docstring above): every routable instance's cost
    # has to be looked at, so the per-instance work is a few list comprehensions over plain attributes
    # (≈ 20-40 ns an instance each, a third of a loop that builds tuples); what depends on the prompt's
    # holders is computed once per holder. Decisions are exactly those of a straightforward loop over the
    # rule (tests/test_choose_equivalence.py keeps one and compares them on random fleets).
    def choose(self, key: RoutingKey, fleet: Fleet) -> Decision:
        up = _routable(fleet, key.model)
        s = self.settings
        blocks = key.blocks(s.block_bytes)
        depths = self.match_depths(blocks, fleet) if blocks else {}
        block_tokens = s.block_bytes // 4
        prompt = key.tokens

        loads = _guard_loads(up)
        cap = min(s.concurrency_threshold,
                  math.ceil((1 + s.balance_factor) * (sum(loads) + 1) / len(up)) + s.balance_slack)
        candidates = _under_cap(up, loads, cap)
        if not candidates:  # everyone is at the guard: least loaded, whatever it holds
            return self._decision(_least_loaded(up), OVERLOAD_SPILL, depths, block_tokens, prompt, blocks)
        alpha = self.miss_weight_for(depths)
        costs = self._costs(candidates, depths, prompt, block_tokens, fleet, alpha)

        best = min(costs)
        slack = alpha * block_tokens / min([i.prefill_tokens_per_s for i in candidates])
        limit = best + slack
        tied = [i for i, c in zip(candidates, costs) if c <= limit]
        if len(tied) > 1 and s.cold_to_least_loaded:
            # Equal cost (typically a cold prefix): keep warm instances' headroom for their own prefixes.
            least = min([i.inflight for i in tied])
            tied = [i for i in tied if i.inflight <= least + s.balance_slack]
        name = tied[0].name if len(tied) == 1 else rendezvous.top(key.prefix_hash(s.prefix_length),
                                                                  [i.name for i in tied])
        inst = fleet.instances[name]
        return self._decision(inst, self._reason(inst, depths), depths, block_tokens, prompt, blocks)

    def miss_weight_for(self, depths: dict[str, int]) -> float:
        """α for this request: private (one instance holds its deepest match) or shared (several, or none)."""
        deepest = max(depths.values(), default=0)
        if deepest > 0 and sum(1 for d in depths.values() if d == deepest) == 1:
            return self.settings.miss_weight
        return self.settings.shared_miss_weight

    def _costs(self, candidates: list[Instance], depths: dict[str, int], prompt: int, block_tokens: int,
               fleet: Fleet, alpha: float) -> list[float]:
        """Estimated time to first token on each candidate (with miss weight α), in the candidates' order."""
        mean = fleet.mean_uncached_tokens
        # Prompt tokens to compute, x α: all of them, except on the (few) instances holding its first blocks.
        miss_all = alpha * prompt
        miss = {name: alpha * max(0, prompt - depth * block_tokens) if depth else miss_all
                for name, depth in depths.items()}
        get = miss.get
        # Prefill queued ahead of this request (the router's books, plus what the engine reports beyond them)
        # plus this request's own; one pass, the engine's term only where it reported.
        return [((i.queued_prefill_tokens if i.engine is None
                  else i.queued_prefill_tokens + backlog_tokens(i.engine, prompt, i.kv_capacity_tokens, mean))
                 + get(i.name, miss_all)) / i.prefill_tokens_per_s for i in candidates]

    def match_depths(self, blocks: list[int], fleet: Fleet) -> dict[str, int]:
        """Cached prefix length (blocks) per instance: the router's estimate (the simulator's oracle overrides)."""
        return fleet.index.match_depths(blocks)

    @staticmethod
    def _reason(inst: Instance, depths: dict[str, int]) -> str:
        if not depths:
            return COLD
        # Not the deepest match: a better-placed instance was over the guard, down, or had a longer queue.
        return CACHE_HIT if depths.get(inst.name, 0) == max(depths.values()) else OVERLOAD_SPILL

    @staticmethod
    def _decision(inst: Instance, reason: str, depths: dict[str, int], block_tokens: int, prompt: int,
                  blocks: list[int]) -> Decision:
        matched = min(prompt, depths.get(inst.name, 0) * block_tokens)
        return Decision(inst.name, reason, matched, prompt, blocks)


STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (CacheAwareStrategy, PrefixStrategy, SessionStrategy, LeastLoadedStrategy,
                        RoundRobinStrategy, RandomStrategy)
}


def make_strategy(name: str, settings: StrategySettings | None = None, seed: int | None = None) -> Strategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}") from None
    return cls(settings, seed=seed)
