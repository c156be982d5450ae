"""Prometheus metrics of one emulated instance, under vLLM's names, read from the model at scrape time.

Each instance has its own CollectorRegistry (several instances share a process); nothing is registered
in prometheus_client's global registry.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from warmroute.engine.model import EngineModel, EngineStats

if TYPE_CHECKING:
    from warmroute.engine.kv_transfer import KvTransfer, TransferStats

PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM's PromptTokenStats
CACHE_TIERS = ("device", "host", "p2p", "disk", "external_unspecified")  # vLLM's CacheHitSource


class Histogram:
    """Observations counted into fixed buckets (upper bounds, ascending), rendered as a Prometheus histogram."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def family(self, name: str, doc: str, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=labels)
        cumulative, total = [], 0
        for bound, count in zip((*map(floatToGoString, self.buckets), "+Inf"), self.counts):
            total += count
            cumulative.append((bound, total))
        family.add_metric(values, cumulative, self.sum)
        return family


class _ModelCollector(Collector):
    def __init__(self, model: EngineModel, model_name: str, behind_s: Callable[[], float] | None = None,
                 transfer: KvTransfer | None = None) -> None:
        self.model = model
        self.model_name = model_name
        self.behind_s = behind_s
        self.transfer = transfer

    def collect(self) -> Iterator[Metric]:
        m, stats, name = self.model, self.model.stats, [self.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", m.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", m.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by running requests (1 = full).",
                    m.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hits)
        yield counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield from self._prompt_sources(stats)
        success = CounterMetricFamily("vllm:request_success", "Requests finished.",
                                      labels=["model_name", "finished_reason"])
        success.add_metric([self.model_name, "length"], stats.requests_finished)  # always runs to max_tokens
        if self.transfer is not None:
            success.add_metric([self.model_name, "error"], stats.requests_failed)  # their KV never came
        yield success
        if self.transfer is not None:
            yield counter("vllm:external_prefix_cache_queries", "Prompt tokens past the local prefix hit, asked of "
                          "the KV connector.", stats.external_queries)
            yield counter("vllm:external_prefix_cache_hits", "Prompt tokens loaded through the KV connector.",
                          stats.external_hits)
            if self.transfer.nixl:
                yield from self._nixl(self.transfer.stats)
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([self.model_name, str(m.config.block_size), str(m.config.capacity_blocks)], 1)
        yield info
        if self.behind_s is not None:  # ours, not vLLM's: how far the emulation fell short of the modelled speed
            yield counter("warmroute_emulation_behind_seconds", "Real seconds this emulated engine fell behind its "
                          "modelled schedule and skipped (its host was too busy): it ran that much slower than the "
                          "engine it models.", self.behind_s())


    def _prompt_sources(self, stats: EngineStats) -> Iterator[Metric]:
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Prompt tokens by source.",
                                        labels=["model_name", "source"])
        for source, value in zip(PROMPT_SOURCES, (stats.computed_tokens, stats.prefix_hits, stats.external_hits)):
            by_source.add_metric([self.model_name, source], value)
        yield by_source
        cached = CounterMetricFamily("vllm:prompt_tokens_cached", "Cached prompt tokens (local and external).",
                                     labels=["model_name"])
        cached.add_metric([self.model_name], stats.prefix_hits + stats.external_hits)
        yield cached
        tiers = CounterMetricFamily("vllm:prompt_tokens_cached_by_source", "Cached prompt tokens by the tier that "
                                    "supplied them (p2p: another instance).", labels=["model_name", "source"])
        for tier in CACHE_TIERS:
            value = {"device": stats.prefix_hits, "p2p": stats.external_hits}.get(tier, 0)
            tiers.add_metric([self.model_name, tier], value)
        yield tiers

    def _nixl(self, t: TransferStats) -> Iterator[Metric]:
        labels, values = ["model_name"], [self.model_name]
        yield t.xfer_time.family("vllm:nixl_xfer_time_seconds", "Transfer duration of NIXL KV cache transfers "
                                 "(modelled seconds).", labels, values)
        yield t.post_time.family("vllm:nixl_post_time_seconds", "Post time of NIXL KV cache transfers.",
                                 labels, values)
        yield t.bytes_transferred.family("vllm:nixl_bytes_transferred", "Bytes per NIXL KV cache transfer.",
                                         labels, values)
        yield t.descriptors.family("vllm:nixl_num_descriptors", "Descriptors (blocks here) per NIXL KV cache "
                                   "transfer.", labels, values)
        for name, doc, value in (
                ("vllm:nixl_num_failed_transfers", "Failed NIXL KV cache transfers, handshakes and notifications "
                 "included.", t.failed_transfers + t.failed_notifications),
                ("vllm:nixl_num_failed_notifications", "Failed NIXL KV cache notifications.", t.failed_notifications),
                ("vllm:nixl_num_kv_expired_reqs", "Requests whose held KV expired (on the prefill instance).",
                 t.kv_expired_reqs),
                ("vllm:nixl_num_notifications_after_expiry", "Completion notifications for requests whose KV lease "
                 "had run out.", t.notifications_after_expiry)):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            yield family


class EngineMetrics:
    content_type = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes

    def __init__(self, model: EngineModel, model_name: str, behind_s: Callable[[], float] | None = None,
                 transfer: KvTransfer | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ModelCollector(model, model_name, behind_s, transfer))

    def render(self) -> bytes:
        return generate_latest(self.registry)
