"""The host set: every instance the router knows, its health and its load, plus the prefix index.

Membership, health and load live here; strategies only read them (Envoy's split between the host set and
the load-balancing policy). The I/O shell and the simulator report what happens through `dispatched`,
`first_token` and `finished`, so both keep identical books.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from warmroute.core.block_hash import BLOCK_BYTES_DEFAULT
from warmroute.core.prefix_index import BYTES_PER_ENTRY, PrefixIndex
from warmroute.core.routing_key import BYTES_PER_TOKEN


@dataclass
class Instance:
    name: str
    kv_capacity_tokens: int
    prefill_tokens_per_s: float = 10_000.0
    healthy: bool = True
    draining: bool = False
    inflight: int = 0
    queued_prefill_tokens: float = 0.0  # uncached prompt tokens sent here that have not had a first token
    requests_total: int = 0
    # Load the engine itself reports (scraped /metrics); None until known.
    engine_waiting: int | None = None
    engine_running: int | None = None
    engine_kv_usage: float | None = None

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining


@dataclass
class FleetSettings:
    block_bytes: int = BLOCK_BYTES_DEFAULT
    index_max_bytes: int = 256 * 1024 * 1024
    default_kv_capacity_tokens: int = 1_000_000
    default_prefill_tokens_per_s: float = 10_000.0


@dataclass
class Fleet:
    settings: FleetSettings = field(default_factory=FleetSettings)
    instances: dict[str, Instance] = field(default_factory=dict)
    index: PrefixIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = PrefixIndex(max(1, self.settings.index_max_bytes // BYTES_PER_ENTRY))

    @property
    def block_tokens(self) -> int:
        return self.settings.block_bytes // BYTES_PER_TOKEN

    # -- membership -------------------------------------------------------------------------------------
    def add(self, name: str, kv_capacity_tokens: int | None = None,
            prefill_tokens_per_s: float | None = None) -> Instance:
        s = self.settings
        inst = self.instances.get(name)
        if inst is None:
            inst = self.instances[name] = Instance(
                name, kv_capacity_tokens or s.default_kv_capacity_tokens,
                prefill_tokens_per_s or s.default_prefill_tokens_per_s)
        elif kv_capacity_tokens:
            inst.kv_capacity_tokens = kv_capacity_tokens
        self.index.add_instance(name, inst.kv_capacity_tokens // self.block_tokens)
        return inst

    def remove(self, name: str) -> None:
        self.instances.pop(name, None)
        self.index.remove_instance(name)

    def routable(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.routable]

    # -- load accounting --------------------------------------------------------------------------------
    def dispatched(self, name: str, uncached_tokens: int, blocks: list[int] | None = None) -> None:
        """A request was sent to `name`; its blocks are now (about to be) cached there."""
        inst = self.instances.get(name)
        if inst is None:
            return
        inst.inflight += 1
        inst.requests_total += 1
        inst.queued_prefill_tokens += uncached_tokens
        if blocks:
            self.index.record(name, blocks)

    def first_token(self, name: str, uncached_tokens: int) -> None:
        """Its prefill is done: the work no longer queues ahead of later requests."""
        inst = self.instances.get(name)
        if inst is not None:
            inst.queued_prefill_tokens = max(0.0, inst.queued_prefill_tokens - uncached_tokens)

    def finished(self, name: str, uncached_tokens: int = 0, got_first_token: bool = True) -> None:
        inst = self.instances.get(name)
        if inst is None:
            return
        inst.inflight = max(0, inst.inflight - 1)
        if not got_first_token:
            self.first_token(name, uncached_tokens)
