"""Routing strategies: given a routing key and the fleet, choose an instance. This is where decisions are made.

Every strategy is a small class with one method, `choose(key, fleet) -> Decision`, doing no I/O, so the HTTP
router and the simulator make exactly the same decision for the same state.

  cache_aware  (default) lowest estimated time to first token, from the prefix index and queued prefill,
               under a bounded-load guard; ties and cold prefixes placed by rendezvous on the prefix. A
               conversation kept on its instance may wait in the router while that instance is full
               (core/admission.py decides; the shells, router/routing.py and sim/simulator.py, wait).
  prefix       the reference's behaviour: rendezvous on the first PrefixLength characters, spilling along
               that prefix's own rendezvous order past ConcurrencyThreshold.
  session      rendezvous on the session id (x-session-id header or `user` field).
  least_loaded, round_robin, random   the baselines.
"""

from __future__ import annotations

import math
import os
import random as _random
from collections.abc import Sequence
from dataclasses import dataclass

from warmroute.core import rendezvous
from warmroute.core.engine_load import backlog_tokens, foreign_requests
from warmroute.core.exact_index import ExactIndex, exact_depths
from warmroute.core.fleet import RECENT_WINDOW, Fleet, Instance
from warmroute.core.popularity import Popularity
from warmroute.core.routing_key import RoutingKey

# Decision reasons (also the label values of the decisions metric).
CACHE_HIT = "cache_hit"  # chosen for the prefix it already holds
COLD = "cold"  # nobody holds the prefix: placed by rendezvous hashing
OVERLOAD_SPILL = "overload_spill"  # the preferred instance was too busy: sent elsewhere
HOT_SPREAD = "hot_spread"  # a hot prefix copied to one more instance: its holders already had their share
KV_SPILL = "kv_spill"  # the one instance holding the prefix is swamped (sticky_kv_limit): sent elsewhere
UNHEALTHY_FALLBACK = "unhealthy_fallback"  # the preferred instance is down or draining
LOAD_BALANCE = "load_balance"  # a load-only strategy chose (least_loaded, round_robin, random)
AFFINITY = "affinity"  # the prefix's or session's own instance (prefix, session)
# Who holds a prompt's deepest match, as cache_aware weighs its miss (CacheAwareStrategy.miss_weight_for).
PRIVATE, SHARED, SWAMPED = "private", "shared", "swamped"
# Where the chosen instance's match came from in precise mode (Decision.match).
PRECISE, APPROXIMATE = "precise", "approximate"
REASONS = (CACHE_HIT, COLD, OVERLOAD_SPILL, HOT_SPREAD, KV_SPILL, UNHEALTHY_FALLBACK, LOAD_BALANCE, AFFINITY)


HOLD_TIMEOUT_S = 5.0  # how long the shells (router, simulator) hold a request at most before it goes anyway


class NoInstanceAvailable(Exception):
    """No healthy instance to route to (the shell answers 503)."""


class ModelNotServed(NoInstanceAvailable):
    """Healthy instances exist, but none of those that serve the request's model is one of them."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no healthy instance serves model {model!r}")
        self.model = model


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 0.5 µs more, on every decision
class Decision:
    instance: str
    reason: str
    matched_tokens: int = 0  # tokens of the prompt the chosen instance is predicted to hold
    prompt_tokens: int = 0
    blocks: Sequence[int] = ()  # the chain to record for the chosen instance
    # cache_aware kept it on the one instance holding its prefix (the private miss weight): it may wait in the
    # router for room there (core/admission.py) rather than be queued where its history would be evicted
    private: bool = False
    # Precise mode: whether the chosen instance's match came from its engine's KV events ("precise") or from the
    # router's cache model ("approximate"); "" where precise mode is off.
    match: str = ""

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.matched_tokens)

    @property
    def kv_tokens(self) -> int:
        """The KV cache this request needs at its instance beyond what other requests there share: all of its
        prompt when its match is its own (private: a conversation's history), else only its uncached tokens
        (a shared prefix is held once, however many requests in flight use it). Counted in flight per instance
        (Instance.inflight_prompt_tokens) for kv_pressure."""
        return self.prompt_tokens if self.private else self.uncached_tokens

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
    # A hot prefix (one carrying at least 1/N of the recent requests) skips the instances that were sent more
    # than (1+δ) x the mean of recent requests, plus a slack: a further copy of it spreads its load. Without
    # it, at a load where queues stay short, a prompt on 60% of requests stayed on two instances (request
    # counts 1.3-1.6x the mean in the simulator; 1.20-1.25 with δ = 0.2, same hit rate; benchmarks/hot_guard.py).
    hot_balance_factor: float = 0.2  # δ
    hot_balance_slack: float = 4.0  # requests
    cold_to_least_loaded: bool = True
    # α: cost of an uncached token relative to a queued one, by who holds the prefix (see CacheAwareStrategy)
    miss_weight: float = 16.0  # one instance holds its deepest match: a private prefix (a conversation)
    shared_miss_weight: float = 1.0  # several do (a popular prefix), or none does
    # ...but only while the holder's in-flight prompts need at most this many times its KV cache (else the
    # shared weight): a swamped engine evicts queued histories anyway. 1.75: chat TTFT p99 -15% for -2.8 points
    # of hit rate in the simulator, no change on the hot and mixed workloads (benchmarks/chat_tail.py).
    sticky_kv_limit: float = 1.75
    # Such a prompt waits in the router while the prompts in flight at its instance, with it, would need more
    # than this many times its KV cache; looked at again whenever a request finishes (core/admission.py). 1.4 with
    # hold_keep 1.5: chat TTFT p99 -11% and +1.3 points of hit rate in the simulator, 8 seeds (-11%, +0.3 over 16;
    # benchmarks/chat_tail.py, docs/benchmarks.md); 1.3 cut more p99 for more hit rate. 1000: never waits.
    hold_kv_limit: float = 1.4
    # A held request keeps the instance first chosen for it (not decided again) while it has waited less than
    # this many times the fleet's mean time to first token: decided again at once, held conversations drifted
    # off their instances (hit rate -2.6 points); kept much longer, the wait itself became the tail.
    hold_keep: float = 1.5
    block_bytes: int = 64


def _least_loaded(instances: list[Instance]) -> Instance:
    return min(instances, key=lambda i: (i.inflight, i.queued_prefill_tokens, i.name))


def _guard_loads(up: list[Instance]) -> list[float]:
    """In-flight requests per instance as the load guard counts them: other routers' requests too, where the
    engine reports them."""
    return [i.inflight if i.engine is None else i.inflight + foreign_requests(i.engine) for i in up]


def kv_pressure(inst: Instance) -> float:
    """The KV cache the requests in flight at an instance need, over its capacity: this router's books, plus
    other routers' requests where the engine reports them (each the size of this router's there)."""
    tokens = inst.inflight_prompt_tokens
    if inst.engine is not None and inst.inflight:
        tokens += foreign_requests(inst.engine) * tokens / inst.inflight
    return tokens / inst.kv_capacity_tokens if inst.kv_capacity_tokens > 0 else 0.0


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


def share_cap(up: list[Instance], hot_factor: float, hot_slack: float) -> float:
    """The most recent requests an instance may have been sent and still take a hot prefix's next one."""
    return (1 + hot_factor) * sum([i.recent for i in up]) / len(up) + hot_slack


def scan_python(up: list[Instance], miss: dict[str, float], miss_all: float, prompt: int, mean: float,
                threshold: int, balance_factor: float, balance_slack: int, hot_factor: float, hot_slack: float,
                slack_tokens: float, least_slack: int) -> Instance | list[Instance] | None:
    """cache_aware's per-instance scan: the cheapest instance under the guard, or the tied ones (the caller
    breaks the tie by rendezvous), or None when every instance is at the guard.

    `miss`: α x uncached tokens per holder (`miss_all` elsewhere); `hot_factor` δ for a hot prefix (< 0: not
    hot), `hot_slack` in units of Instance.recent; `slack_tokens`: α x one block, costs within that of the
    cheapest tie; `least_slack`: among tied ones keep those within this many in-flight requests of the least
    loaded (< 0: keep all)."""
    loads = _guard_loads(up)
    cap = min(threshold, math.ceil((1 + balance_factor) * (sum(loads) + 1) / len(up)) + balance_slack)
    candidates = _under_cap(up, loads, cap)
    if not candidates:
        return None
    if hot_factor >= 0:  # a hot prefix: not onto an instance already sent more than its share
        cap_recent = share_cap(up, hot_factor, hot_slack)
        candidates = [i for i in candidates if i.recent <= cap_recent] or candidates
    get = miss.get
    # Prefill queued ahead (the router's books, plus what the engine reports beyond them) plus this request's
    # own, over the prefill rate; the engine's term only where it reported.
    costs = [((i.queued_prefill_tokens if i.engine is None
               else i.queued_prefill_tokens + backlog_tokens(i.engine, prompt, i.kv_capacity_tokens, mean))
              + get(i.name, miss_all)) / i.prefill_tokens_per_s for i in candidates]
    limit = min(costs) + slack_tokens / min([i.prefill_tokens_per_s for i in candidates])
    tied = [i for i, c in zip(candidates, costs) if c <= limit]
    if len(tied) > 1 and least_slack >= 0:
        # Equal cost (typically a cold prefix): keep warm instances' headroom for their own prefixes.
        least = min([i.inflight for i in tied])
        tied = [i for i in tied if i.inflight <= least + least_slack]
    return tied[0] if len(tied) == 1 else tied


def top_python(seed: int, tied: list[Instance]) -> Instance:
    """The tied instance the seed's rendezvous order puts first (rendezvous.top over their names)."""
    name = rendezvous.top(seed, [i.name for i in tied])
    return next(i for i in tied if i.name == name)


# The compiled versions (core/_scan.c), where a C compiler was found at install: the same decisions.
try:
    if os.environ.get("WARMROUTE_PURE_PYTHON") == "1":  # to run (and test) the fallback where the C one exists
        raise ImportError("WARMROUTE_PURE_PYTHON=1")
    from warmroute.core import _scan
except ImportError:
    _scan = None
if _scan is not None:
    _scan.configure(Instance, rendezvous.hash_fn, rendezvous.name_bytes, rendezvous.encoded,
                    rendezvous.hash_fn_address())
scan = _scan.scan if _scan is not None else scan_python
top = _scan.top if _scan is not None else top_python


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
    # Usually the first in the order is up and under the threshold: its top alone, without sorting them all.
    first = top(hash_key, list(fleet.instances.values()) if serving is None
                else [fleet.instances[n] for n in sorted(serving)])
    if first is not None and first.routable and first.inflight < threshold:
        return first, AFFINITY
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

    For every routable instance under the bounded-load guard (in-flight < ConcurrencyThreshold and below
    (1+ε) x mean + slack):
        cost = (prefill tokens already queued there + α x this request's tokens not cached there) / rate
    The cheapest wins. α weighs a cache miss against queueing, and depends on who holds the prefix:
      * one instance holds the deepest match (a conversation's history, a document being asked about):
        α = 16. Sending the request elsewhere recomputes all of it and strands the only warm copy, and
        every later turn pays again; kept on its instance, a conversation's blocks are the freshest there
        and survive until its next turn. (With α = 2 for everything, long multi-turn chats moved between
        instances and hit 31-42% where sticky routing hits 55-65%; docs/benchmarks.md.) Unless that
        instance is swamped: where the prompts in flight there need more than `sticky_kv_limit` (1.75) x
        its KV cache, the engine evicts a queued conversation's history before its turn comes (9% of it
        left above 1.25 x, benchmarks/chat_tail.py), so staying buys nothing: α = 1, as for a shared one.
      * several instances hold it (a popular system prompt), or none: α = 1, this request's own time to
        first token. One more copy of a prefix already proven popular is an investment that spreads its
        load; α = 2 here pinned a hot prompt to a few instances (request counts 1.6x the mean).
    A prompt kept on the one instance holding its prefix at α = 16 (`Decision.private`) is held back, in the
    router, while the prompts in flight there, with it, would need more than `hold_kv_limit` (1.4) x its KV
    cache (core/admission.py): queued in the engine, it would lose its history to the requests admitted ahead
    of it. It looks again whenever a request finishes, keeping its instance for `hold_keep` (1.5) x the fleet's
    mean time to first token, then any instance with room may take it.
    A hot prefix, one on at least 1/N of the recent requests (N routable instances; counted per end of the
    longest match, so a conversation's history never is), skips the instances that were sent more than
    (1+δ) x the mean of recent requests (+ a slack), unless all were: at a load where queues stay short the
    cost alone keeps it on the instances that hold it, however many requests it brings them.
    Instances within one block of the cheapest tie: the less loaded of them, then the highest in the prefix's
    rendezvous order, so cold prefixes land where other router replicas would put them, and a hot prefix warms
    a small, stable set of instances instead of one (the guard makes it spill) or all of them. Where the engines
    report their own load (scraped /metrics), what other routers sent there counts as in flight and as queued
    prefill too (core/engine_load.py); without such reports the rule is exactly the above.
    """

    name = "cache_aware"
    records_prefixes = True

    def __init__(self, settings: StrategySettings | None = None, seed: int | None = None) -> None:
        super().__init__(settings)
        self.popularity = Popularity()  # per deepest matched block: which prefixes are hot
        self.exact: ExactIndex | None = None  # precise mode: the engines' own reports, where fresh

    # How the rule is computed (the rule itself is in the docstring above): what depends on the prompt's
    # holders is computed once per holder (`miss`); then one scan over the routable instances applies the guard,
    # the costs and the tie (`_scan`). The scan is compiled where a C compiler was found (`_scan.c`, the same
    # rule, one pass instead of five comprehensions); this Python version is its fallback and reference.
    # Decisions are exactly those of a straightforward loop over the rule (tests/test_choose_equivalence.py
    # keeps one and compares both versions with it on random fleets).
    def choose(self, key: RoutingKey, fleet: Fleet) -> Decision:
        up = _routable(fleet, key.model)
        s = self.settings
        blocks = key.blocks(s.block_bytes)
        depths = self.match_depths(blocks, fleet) if blocks else {}
        precise: dict[str, float] = {}  # instance -> share of the prompt its engine reports holding
        if self.exact is not None and key.token_data is not None:
            depths, precise = exact_depths(self.exact, key, len(blocks), depths)
        block_tokens = s.block_bytes // 4
        prompt = key.tokens
        alpha, held_by = self.miss_weight_for(depths, fleet)
        # Popularity is counted per end of the longest match (a hot system prompt's last cached block).
        prefix = blocks[min(max(depths.values()), len(blocks)) - 1] if depths and blocks else None
        hot = prefix is not None and self.popularity.share(prefix) * len(up) >= 1.0
        self.popularity.add(prefix, RECENT_WINDOW * len(up))
        # Prompt tokens to compute, x α: all of them, except on the (few) instances holding its first blocks.
        miss_all = alpha * prompt
        miss = {name: alpha * max(0, prompt - depth * block_tokens) if depth else miss_all
                for name, depth in depths.items()}
        found = scan(up, miss, miss_all, prompt, fleet.mean_uncached_tokens, s.concurrency_threshold,
                     s.balance_factor, s.balance_slack, s.hot_balance_factor if hot else -1.0,
                     s.hot_balance_slack * fleet.recent_unit.value, alpha * block_tokens,
                     s.balance_slack if s.cold_to_least_loaded else -1)
        if found is None:  # everyone is at the guard: least loaded, whatever it holds
            decision = self._decision(_least_loaded(up), OVERLOAD_SPILL, depths, block_tokens, prompt, blocks)
        else:
            inst = found if isinstance(found, Instance) else top(key.prefix_hash(s.prefix_length), found)
            reason = self._reason(inst, depths)
            if reason == OVERLOAD_SPILL and held_by == SWAMPED:
                reason = KV_SPILL
            elif reason == OVERLOAD_SPILL and hot and self._holders_had_their_share(up, depths, fleet):
                reason = HOT_SPREAD
            decision = self._decision(inst, reason, depths, block_tokens, prompt, blocks,
                                      held_by == PRIVATE and reason == CACHE_HIT)
        if self.exact is not None:
            share = precise.get(decision.instance)
            decision.match = APPROXIMATE if share is None else PRECISE
            if share is not None:  # exactly what the engine reported, not rounded to the key's blocks
                decision.matched_tokens = round(share * prompt)
        return decision

    def miss_weight_for(self, depths: dict[str, int], fleet: Fleet) -> tuple[float, str]:
        """α for this request, and why: PRIVATE (one instance holds its deepest match), SHARED (several do, or
        none) or SWAMPED (one does, but it is past sticky_kv_limit: the shared weight)."""
        if not depths:  # a cold prompt (depths lists holders only, each with at least one block)
            return self.settings.shared_miss_weight, SHARED
        if len(depths) == 1:  # the usual private case (a conversation's history), without a max and a list
            name = next(iter(depths))
        else:
            deepest = max(depths.values())
            holders = [n for n, d in depths.items() if d == deepest]
            if len(holders) != 1:
                return self.settings.shared_miss_weight, SHARED
            name = holders[0]
        holder = fleet.instances.get(name)
        if holder is not None and kv_pressure(holder) > self.settings.sticky_kv_limit:
            return self.settings.shared_miss_weight, SWAMPED
        return self.settings.miss_weight, PRIVATE

    def match_depths(self, blocks: Sequence[int], fleet: Fleet) -> dict[str, int]:
        """Cached prefix length (blocks) per instance: the router's estimate (the simulator's oracle overrides)."""
        return fleet.index.match_depths(blocks)

    @staticmethod
    def _reason(inst: Instance, depths: dict[str, int]) -> str:
        if not depths:
            return COLD
        # Not the deepest match: a better-placed instance was over the guard, down, or had a longer queue.
        return CACHE_HIT if depths.get(inst.name, 0) == max(depths.values()) else OVERLOAD_SPILL

    def _holders_had_their_share(self, up: list[Instance], depths: dict[str, int], fleet: Fleet) -> bool:
        """Whether the hot-prefix guard kept a holder of the deepest match out (else: the queue or the load
        guard did)."""
        cap = share_cap(up, self.settings.hot_balance_factor,
                        self.settings.hot_balance_slack * fleet.recent_unit.value)
        deepest = max(depths.values())
        return any(i.recent > cap for i in up if depths.get(i.name) == deepest)

    @staticmethod
    def _decision(inst: Instance, reason: str, depths: dict[str, int], block_tokens: int, prompt: int,
                  blocks: Sequence[int], private: bool = False) -> Decision:
        matched = min(prompt, depths.get(inst.name, 0) * block_tokens)
        return Decision(inst.name, reason, matched, prompt, blocks, private)


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
