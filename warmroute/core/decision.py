"""What a strategy returns: the chosen instance and why, and the errors that mean there is no instance to choose."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Decision reasons (also the label values of the decisions metric).
CACHE_HIT = "cache_hit"  # chosen for the prefix it already holds
COLD = "cold"  # nobody holds the prefix: placed by rendezvous hashing
OVERLOAD_SPILL = "overload_spill"  # the preferred instance was too busy: sent elsewhere
HOT_SPREAD = "hot_spread"  # a hot prefix copied to one more instance: its holders already had their share
KV_SPILL = "kv_spill"  # the one instance holding the prefix is swamped (sticky_kv_limit): sent elsewhere
UNHEALTHY_FALLBACK = "unhealthy_fallback"  # the preferred instance is down or draining
LOAD_BALANCE = "load_balance"  # a load-only strategy chose (least_loaded, round_robin, random)
AFFINITY = "affinity"  # the prefix's or session's own instance (prefix, session)
# The slow-start ramp decided: a hot prefix copied first to an instance that is warming up, or a request kept off
# the warming instance holding its prefix because it had had its ramped share (stages/slow_start.py).
SLOW_START = "slow_start"
# Where the chosen instance's match came from in precise mode (Decision.match).
PRECISE, APPROXIMATE = "precise", "approximate"
TOKENIZE_FAILED = "tokenize_failed"  # Decision.note: precise mode could not tokenize the request (approximate)
REASONS = (CACHE_HIT, COLD, OVERLOAD_SPILL, HOT_SPREAD, KV_SPILL, UNHEALTHY_FALLBACK, LOAD_BALANCE, AFFINITY,
           SLOW_START)


class NoInstanceAvailable(Exception):
    """No healthy instance to route to (the shell answers 503)."""


class ModelNotServed(NoInstanceAvailable):
    """Healthy instances exist, but none of those that serve the request's model is one of them."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no healthy instance serves model {model!r}")
        self.model = model


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ is slower, and this is built per decision
class Decision:
    instance: str
    reason: str
    matched_tokens: int = 0  # tokens of the prompt the chosen instance is predicted to hold
    prompt_tokens: int = 0
    blocks: Sequence[int] = ()  # the chain to record for the chosen instance
    # Kept on the one instance holding its prefix at the private miss weight: it may wait in the router for room
    # there (core/admission/) rather than be queued where its history would be evicted.
    private: bool = False
    # Precise mode: whether the chosen instance's match came from its engine's KV events ("precise") or from the
    # router's cache model ("approximate"); "" where precise mode is off.
    match: str = ""
    waited_for: str = ""  # why it waited in the router's queue (core/admission's WAIT_REASONS); "": it did not
    note: str = ""  # why the match is approximate where precise mode could not help (TOKENIZE_FAILED)
    depth: int = 0  # blocks of `blocks` the chosen instance is predicted to hold (its prefix-index match)

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
