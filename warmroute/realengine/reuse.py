"""How many prompt tokens llama.cpp reused from its prefix cache, counted inside the engine.

llama-cpp-python's server (0.3.x) reports neither `usage.prompt_tokens_details.cached_tokens` nor llama.cpp's
`timings.cache_n`, and sends no usage at all when streaming. So the engine's own reuse is measured where it
happens: every prompt goes through `Llama.generate`, which evaluates only the tokens after the prefix it could
reuse (from the live context or from a state restored from `--cache`); the tokens `Llama.eval` sees before the
first sampled token are the ones it recomputed. The totals are published under vLLM's counter names so
warmroute's bench computes the fleet hit rate from them exactly as it does for vLLM.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


@dataclass
class ReuseCounters:
    queries: int = 0  # prompt tokens seen
    hits: int = 0  # of them, not recomputed
    evaluated: int = 0  # every token Llama.eval was given (prompt and generated)

    def prometheus(self) -> str:
        return "".join(f"# TYPE {name} counter\n{name} {value}\n"
                       for name, value in ((QUERIES, self.queries), (HITS, self.hits)))


def install(counters: ReuseCounters) -> None:
    """Wrap `Llama.eval` and `Llama.generate` (this process only) to feed `counters`."""
    from llama_cpp import Llama

    original_eval, original_generate = Llama.eval, Llama.generate

    def eval(self: Any, tokens: Sequence[int]) -> None:
        counters.evaluated += len(tokens)
        return original_eval(self, tokens)

    def generate(self: Any, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Generator[int, Any, None]:
        tokens = list(tokens)
        before = counters.evaluated
        inner = original_generate(self, tokens, *args, **kwargs)
        try:
            token = next(inner)  # the prompt has been evaluated once the first token is sampled
        except StopIteration:
            return
        counters.queries += len(tokens)
        counters.hits += max(0, len(tokens) - (counters.evaluated - before))
        while True:  # pass on what the caller sends, as `yield from` would
            sent = yield token
            try:
                token = inner.send(sent)
            except StopIteration:
                return

    Llama.eval, Llama.generate = eval, generate
