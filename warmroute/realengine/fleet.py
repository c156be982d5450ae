"""A fleet of real llama.cpp engines on these CPUs behind warmroute, one routing strategy at a time.

For each strategy: start fresh engines (cold caches) serving the tiny model, start `warmroute serve` in front
of them, drive a shared-prefix workload through it with warmroute's load generator, stop everything (also on
error or Ctrl-C). Each engine's `--cache` holds only a few prompts' state, fewer than the workload's shared
prefixes, so the fleet can keep every prefix warm only if requests that share one meet on the same engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import ClassVar

from warmroute.bench.loadgen import BenchSettings, run_bench
from warmroute.bench.processes import Child, free_ports
from warmroute.bench.stats import BenchResult
from warmroute.core.routing_key import BYTES_PER_TOKEN
from warmroute.realengine.tiny_model import TinyModelSpec
from warmroute.workloads import Session, Workload
from warmroute.workloads.shared import SharedPrompts

SERVER_MODULE = "warmroute.realengine.server"
MODEL_ALIAS = "warmroute-tiny"
TEMPLATE_TOKENS = 64  # llama-2 chat template around the messages, and slack
STATE_OVERHEAD_BYTES = 128 << 10  # per cached state beyond its KV rows, with margin over the measured (docs/tuning.md)


@dataclass(frozen=True)
class LlamaFleetPlan:
    engines: int = 4
    cached_prompts: int = 3  # prompt states each engine's --cache holds
    prefixes: int = 8  # shared system prompts, equally popular
    system_tokens: int = 900  # in warmroute's 4-bytes-per-token estimate: 3.6 kB, one llama token per byte
    question_tokens: int = 40
    max_tokens: int = 8
    concurrency: int = 4  # sessions in flight (closed loop)
    requests: int | None = None  # per strategy; None: as many as fit in warmup + duration
    warmup_s: float = 10.0
    duration_s: float = 60.0
    seed: int = 0
    model: TinyModelSpec = field(default_factory=TinyModelSpec)

    def workload(self) -> Workload:
        shared = SharedPrompts(seed=self.seed, model=MODEL_ALIAS, max_tokens=self.max_tokens,
                               pool_size=self.prefixes, system_tokens=self.system_tokens,
                               question_tokens=self.question_tokens, zipf=0.0)
        return shared if self.requests is None else FirstSessions(inner=shared, count=self.requests)

    def prompt_tokens(self) -> int:
        """llama tokens of one prompt and its answer (one per byte of text)."""
        return (self.system_tokens + self.question_tokens) * BYTES_PER_TOKEN + TEMPLATE_TOKENS + self.max_tokens

    def cache_bytes(self) -> int:
        return self.cached_prompts * (self.prompt_tokens() * self.model.kv_bytes_per_token() + STATE_OVERHEAD_BYTES)

    def engine_args(self, model_path: Path, port: int) -> list[str]:
        return ["--model", str(model_path), "--model_alias", MODEL_ALIAS, "--n_ctx", str(self.model.n_ctx),
                "--n_threads", "1", "--n_threads_batch", "1",  # prefill uses n_threads_batch (default: all cores)
                "--cache", "true", "--cache_type", "ram", "--cache_size", str(self.cache_bytes()),
                "--interrupt_requests", "false",  # by default a queued request ends the running stream early
                "--verbose", "false", "--host", "127.0.0.1", "--port", str(port)]

    def router_args(self, strategy: str, port: int, urls: list[str]) -> list[str]:
        # the router counts 4 bytes per token: tell it what an engine's cache holds in its units
        capacity = self.cached_prompts * self.prompt_tokens() // BYTES_PER_TOKEN
        args = ["serve", "--port", str(port), "--strategy", strategy, "--kv-capacity-tokens", str(capacity)]
        for i, url in enumerate(urls):
            args += ["--backend", f"engine-{i}={url}"]
        return args


@dataclass
class FirstSessions(Workload):
    """The first `count` sessions of another workload: a fixed number of requests per run."""

    name: ClassVar[str] = "first"
    inner: Workload = field(default_factory=SharedPrompts)
    count: int = 40

    def sessions(self) -> Iterator[Session]:
        return islice(self.inner.sessions(), self.count)

    def working_set_tokens(self, concurrency: int = 1) -> int:
        return self.inner.working_set_tokens(concurrency)


async def compare(plan: LlamaFleetPlan, strategies: list[str], model_path: Path, log_dir: Path,
                  progress: bool = False) -> list[BenchResult]:
    return [await run_strategy(s, plan, model_path, log_dir, progress) for s in strategies]


async def run_strategy(strategy: str, plan: LlamaFleetPlan, model_path: Path, log_dir: Path,
                       progress: bool = False) -> BenchResult:
    """Fresh engines and a fresh router for one strategy; every process stopped whatever happens."""
    port = free_ports(plan.engines)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(plan.engines)]
    with ExitStack() as stack:
        engines = [stack.enter_context(Child(f"llama-{strategy}-{i}", plan.engine_args(model_path, port + i),
                                             log_dir, module=SERVER_MODULE))
                   for i in range(plan.engines)]
        for engine, url in zip(engines, urls):
            await engine.wait_for_http(url + "/health", timeout_s=120)
        router_port = free_ports(1, port + plan.engines)
        router = stack.enter_context(Child(f"router-{strategy}", plan.router_args(strategy, router_port, urls),
                                           log_dir))
        target = f"http://127.0.0.1:{router_port}"
        await router.wait_for_http(target + "/health", timeout_s=30)
        settings = BenchSettings(concurrency=plan.concurrency, duration_s=plan.duration_s, warmup_s=plan.warmup_s,
                                 seed=plan.seed, model=MODEL_ALIAS, engine_metrics=[u + "/metrics" for u in urls],
                                 label=strategy, progress=progress, drain_s=30.0)
        return await run_bench(target, plan.workload(), settings)
