"""Disaggregated prefill and decode: whether to split a request, and where each of its two legs goes.

In a fleet whose instances have roles (prefill, decode, or both), a request is either sent whole to a decode
instance (direct), or split: its prompt is prefilled at a prefill instance, whose KV cache then moves to the
decode instance that generates the answer. The strategy chooses both: the decode instance over the decode pool
(its load guard keeps room for a long generation; a prefix it holds saves transfer), the prefill instance over
the prefill pool (the prompt's cached prefix and queued prefill: all of a prefill leg is prompt work). A request
whose prompt is mostly cached at its decode instance, or short, is not worth a transfer and goes there whole
(llm-d's threshold, measured on the uncached tokens); so does one whose first token the prefill pool's queue
would delay past computing it at the decode instance (the estimated time to first token of both ways). Pure:
the shells run the legs (router/proxy.py, sim/simulator.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from warmroute.core.decision import Decision, NoInstanceAvailable
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.routing_key import RoutingKey
from warmroute.core.settings_model import SettingsModel
from warmroute.core.stages.estimated_ttft import ttft_s
from warmroute.core.stages.routable import routable
from warmroute.core.strategies import Strategy

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLES = (PREFILL, DECODE, BOTH)

# Why a request in a disaggregated fleet was split or not (x-warmroute-reason's pd=..., a metric label).
SPLIT = "split"  # prefilled at one instance, decoded at another
SHORT_PROMPT = "short_prompt"  # too little of it to prefill for a transfer to pay
CACHED_AT_DECODE = "cached_at_decode"  # its decode instance holds enough of it already
NO_PREFILL = "no_prefill_instance"  # no healthy prefill instance other than the decode one
PREFILL_BACKLOG = "prefill_backlog"  # its first token would come later through the prefill pool's queue
NOT_SPLITTABLE = "not_splittable"  # a path or strategy the legs cannot be run for (no prompt, no prefix index)
PD_REASONS = (SPLIT, SHORT_PROMPT, CACHED_AT_DECODE, NO_PREFILL, PREFILL_BACKLOG, NOT_SPLITTABLE)


class DisaggregationSettings(SettingsModel):
    """How the router splits requests in a fleet whose instances have roles (backends' `role`)."""

    pd_threshold_tokens: int = Field(512, ge=0, le=10_000_000)
    """A request is split only when its decode instance would have at least this many of its prompt tokens to compute
    (its prompt less what that instance holds); below, it goes there whole. At or above, it goes there whole too when
    the prefill pool's queue would make its first token later than computing it there. 0: every request with a token
    to compute is split unless the prefill pool is slower."""
    pd_transfer: Literal["nixl", "storage", "bootstrap"] = "nixl"
    """How the engines move the KV cache between the legs: nixl (vLLM's NixlConnector, P2P connectors: the prefill
    answer's kv_transfer_params go with the decode leg), storage (a shared-storage connector: the same two legs, no
    parameters), bootstrap (SGLang: both legs at once, with bootstrap_host, bootstrap_port and bootstrap_room)."""


@dataclass(slots=True)
class Plan:
    """A request's legs: `decode` answers it; `prefill`, when split, computes its prompt first (or alongside)."""

    decode: Decision
    prefill: Decision | None
    why: str

    @property
    def split(self) -> bool:
        return self.prefill is not None

    @property
    def first(self) -> Decision:
        """The leg sent first (the one admission holds the request for)."""
        return self.prefill if self.prefill is not None else self.decode

    @property
    def pool(self) -> str:
        """The pool of the first leg."""
        return PREFILL if self.prefill is not None else DECODE


def takes(inst: Instance, pool: str) -> bool:
    """Whether `inst` may take a leg for `pool` ("" or both: a whole request in a fleet without roles)."""
    return inst.role == BOTH or pool in ("", BOTH) or inst.role == pool


def pool_of(fleet: Fleet, pool: str, model: str | None, but: str | None = None) -> list[Instance]:
    """The routable instances of `pool` that serve `model`, but `but`."""
    return [i for i in routable(fleet, model) if takes(i, pool) and i.name != but]


def plan(strategy: Strategy, key: RoutingKey, fleet: Fleet, settings: DisaggregationSettings) -> Plan:
    """Whether to split the request, and its instances. Raises NoInstanceAvailable when no decode instance is up."""
    decoders = pool_of(fleet, DECODE, key.model)
    if not decoders:
        raise NoInstanceAvailable("no healthy decode instance")
    decode = strategy.choose(key, fleet, decoders)
    return plan_for_decode(strategy, key, fleet, settings, decode)


def plan_for_decode(strategy: Strategy, key: RoutingKey, fleet: Fleet, settings: DisaggregationSettings,
                    decode: Decision) -> Plan:
    """The rest of the plan once its decode instance is chosen."""
    if decode.uncached_tokens < max(1, settings.pd_threshold_tokens):
        return Plan(decode, None, CACHED_AT_DECODE if decode.matched_tokens else SHORT_PROMPT)
    prefillers = pool_of(fleet, PREFILL, key.model, but=decode.instance)
    if not prefillers:
        return Plan(decode, None, NO_PREFILL)
    prefill = strategy.choose(key, fleet, prefillers)
    if _ttft_s(fleet, prefill) > _ttft_s(fleet, decode):
        return Plan(decode, None, PREFILL_BACKLOG)
    return Plan(decode, prefill, SPLIT)


def _ttft_s(fleet: Fleet, d: Decision) -> float:
    return ttft_s(fleet.instances[d.instance], d.uncached_tokens, d.prompt_tokens, fleet.mean_uncached_tokens)


def decode_after(strategy: Strategy, key: RoutingKey, fleet: Fleet, prefill: str) -> Decision:
    """The decode instance for a request whose prefill instance is already `prefill` (admission gave it one)."""
    decoders = pool_of(fleet, DECODE, key.model, but=prefill)
    if not decoders:
        raise NoInstanceAvailable("no healthy decode instance")
    return strategy.choose(key, fleet, decoders)
