"""Scraping each instance's /metrics for the load and KV capacity the engine reports itself.

Names understood (the rest of the page is ignored):
  vLLM    vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc (older:
          vllm:gpu_cache_usage_perc), vllm:cache_config_info{num_gpu_blocks, block_size}
  SGLang  sglang:num_queue_reqs, sglang:num_running_reqs, sglang:token_usage, sglang:max_total_num_tokens
Counts are summed over an engine's series (one per data-parallel rank), usage takes the busiest.

A scrape that fails, answers an error, cannot be parsed or has none of these names is counted in
`warmroute_engine_scrape_errors_total{backend,kind}` and forgets what the last one said, so routing falls
back to the router's own books; it never ejects the instance (that is health.py's job).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from warmroute.core.fleet import Fleet, Instance
from warmroute.prometheus_text import Samples, read_samples
from warmroute.router.connections import Poller, Upstreams
from warmroute.router.members import Member
from warmroute.router.metrics import Metrics
from warmroute.router.settings import RouterSettings

log = logging.getLogger("warmroute.router")

WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
VLLM_CACHE_INFO = "vllm:cache_config_info"
SGLANG_CAPACITY = "sglang:max_total_num_tokens"
_NAMES = (*WAITING, *RUNNING, *KV_USAGE, VLLM_CACHE_INFO, SGLANG_CAPACITY)


class MalformedMetrics(ValueError):
    """The page is not Prometheus text."""


@dataclass(frozen=True)
class EngineSignals:
    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None  # 0..1
    capacity_tokens: int | None = None

    @property
    def has_load(self) -> bool:
        return self.waiting is not None or self.running is not None or self.kv_usage is not None


def parse_engine_metrics(text: str) -> EngineSignals:
    """The signals in a /metrics page; MalformedMetrics if a line we read is not Prometheus text."""
    try:
        samples = read_samples(text, _NAMES)
    except ValueError as exc:
        raise MalformedMetrics(str(exc)) from None

    def values(names: tuple[str, ...]) -> list[float]:
        found = next((samples[n] for n in names if n in samples), [])
        return [v for _, v in found if v == v and v >= 0]  # drop NaN and negatives

    waiting, running, usage = values(WAITING), values(RUNNING), values(KV_USAGE)
    return EngineSignals(int(sum(waiting)) if waiting else None, int(sum(running)) if running else None,
                         max(usage) if usage else None, _capacity(samples))


def _capacity(samples: Samples) -> int | None:
    """KV capacity in tokens: vLLM's num_gpu_blocks x block_size labels, or SGLang's gauge."""
    for labels, _ in samples.get(VLLM_CACHE_INFO, []):
        try:
            tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            continue
        if tokens > 0:
            return tokens
    sglang = [v for _, v in samples.get(SGLANG_CAPACITY, []) if v == v and v > 0]
    return int(max(sglang)) if sglang else None


@dataclass(frozen=True)
class ScrapeSettings:
    interval: float  # seconds between two scrapes of every instance
    timeout: float  # of one scrape

    @classmethod
    def of(cls, s: RouterSettings) -> ScrapeSettings:
        return cls(s.engine_metrics_interval, s.health_timeout)


class EngineScraper(Poller):
    """A component: every `interval` seconds, GET /metrics on every instance, hand the figures to the fleet.
    Follows membership (members.py) for the instances it scrapes."""

    name = "engine-metrics"

    def __init__(self, fleet: Fleet, upstreams: Upstreams, settings: ScrapeSettings, metrics: Metrics,
                 limit: Callable[[Instance], int | None] | None = None) -> None:
        super().__init__(fleet, upstreams, settings.interval)
        self.settings = settings
        self.metrics = metrics
        self.limit = limit  # the admission queue's view of an engine's capacity (warmroute_engine_capacity)
        # Instances whose KV capacity the user did not give: the engine's own figure replaces the default.
        self._learn_capacity: set[str] = set()
        self._told: set[str] = set()  # of those, the ones whose capacity (or its absence) was logged

    def added(self, member: Member) -> None:
        """An instance without a configured capacity takes the one its engine reports."""
        super().added(member)
        if not member.capacity_configured:
            self._learn_capacity.add(member.name)
            self._told.discard(member.name)

    def removed(self, name: str) -> None:
        super().removed(name)
        self._learn_capacity.discard(name)
        self._told.discard(name)

    async def round(self) -> None:
        await self.scrape_all(self.upstreams.session)

    async def scrape_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.scrape(session, name) for name in list(self.urls)))

    async def scrape(self, session: aiohttp.ClientSession, name: str) -> None:
        signals = await self._fetch(session, name)
        if signals is None:
            self.fleet.engine_load(name, None, None, None)
            return
        if not signals.has_load:
            self.metrics.scrape_error(name, "missing")
        self.fleet.engine_load(name, signals.waiting, signals.running, signals.kv_usage)
        if self.limit is not None and name in self.fleet.instances:
            self.metrics.set_engine_capacity(name, self.limit(self.fleet.instances[name]))
        capacity = signals.capacity_tokens
        inst = self.fleet.instances.get(name)
        if name not in self._learn_capacity or inst is None:
            return
        if capacity and inst.kv_capacity_tokens != capacity:
            self.fleet.add(name, capacity)
        if name not in self._told:  # once per instance: what the index and sticky_kv_limit will assume
            self._told.add(name)
            if capacity:
                log.info("instance %s: KV capacity %s tokens, from its /metrics", name, f"{capacity:,}")
            else:
                log.warning("instance %s: no KV capacity configured and none in its /metrics (vLLM's "
                            "cache_config_info, SGLang's max_total_num_tokens): assuming %s tokens, which sizes its "
                            "share of the prefix index and when a conversation is let go (sticky_kv_limit); set "
                            "kv_capacity_tokens for it", name, f"{inst.kv_capacity_tokens:,}")

    async def _fetch(self, session: aiohttp.ClientSession, name: str) -> EngineSignals | None:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout)
        base = self.urls.get(name)
        if base is None:  # removed from the fleet (discovery) since this round began
            return None
        try:
            async with session.get(base + "/metrics", timeout=timeout) as resp:
                body = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError):
            self.metrics.scrape_error(name, "fetch")
            return None
        if status != 200:
            self.metrics.scrape_error(name, "status")
            return None
        try:
            return parse_engine_metrics(body.decode("utf-8", "replace"))
        except MalformedMetrics:
            self.metrics.scrape_error(name, "malformed")
            return None
