"""Small fleets, chat keys and a conversation held on one instance: what the core's strategy and admission tests
build their cases from."""

from __future__ import annotations

from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.routing_key import key_for_json
from warmroute.core.strategies import StrategySettings, make_strategy


def fleet(n: int = 4, capacity: int = 200_000) -> Fleet:
    f = Fleet(FleetSettings())
    for i in range(n):
        f.add(f"i{i}", capacity)
    return f


def key(system: str, user: str = "question", model: str = "m"):
    return key_for_json("/v1/chat/completions", {"model": model, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})


SYSTEM = "You are a careful assistant for the billing team. " * 60  # ~3,000 characters


def conversation_on_the_first_of_two():
    """Two instances of 10,000 KV tokens; only the first holds a conversation's prefix and has 4 requests in
    flight there, a queue worth 4 of its prompts (between 1 and 16 x the prompt)."""
    f = fleet(2, capacity=10_000)
    s = make_strategy("cache_aware", StrategySettings(balance_factor=10.0))
    a, b = sorted(f.instances)
    k = key(SYSTEM, "q1")
    f.index.record(a, k.blocks())
    holder = f.instances[a]
    holder.inflight, holder.queued_prefill_tokens = 4, 4 * k.tokens
    return f, s, a, b, k, holder
