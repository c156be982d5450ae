"""Prometheus metrics of one emulated instance, under vLLM's names, read from the model at scrape time.

Each instance has its own CollectorRegistry (several instances share a process); nothing is registered
in prometheus_client's global registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from warmroute.engine.model import EngineModel


class _ModelCollector(Collector):
    def __init__(self, model: EngineModel, model_name: str, behind_s: Callable[[], float] | None = None) -> None:
        self.model = model
        self.model_name = model_name
        self.behind_s = behind_s

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
        success = CounterMetricFamily("vllm:request_success", "Requests finished.",
                                      labels=["model_name", "finished_reason"])
        success.add_metric([self.model_name, "length"], stats.requests_finished)  # always runs to max_tokens
        yield success
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([self.model_name, str(m.config.block_size), str(m.config.capacity_blocks)], 1)
        yield info
        if self.behind_s is not None:  # ours, not vLLM's: how far the emulation fell short of the modelled speed
            yield counter("warmroute_emulation_behind_seconds", "Real seconds this emulated engine fell behind its "
                          "modelled schedule and skipped (its host was too busy): it ran that much slower than the "
                          "engine it models.", self.behind_s())


class EngineMetrics:
    content_type = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes

    def __init__(self, model: EngineModel, model_name: str, behind_s: Callable[[], float] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ModelCollector(model, model_name, behind_s))

    def render(self) -> bytes:
        return generate_latest(self.registry)
