"""Read the engines' prefix-cache counters from their Prometheus /metrics, to compute the fleet's hit rate."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

HITS = "vllm:prefix_cache_hits_total"  # tokens served from the prefix cache
QUERIES = "vllm:prefix_cache_queries_total"  # prompt tokens looked up


@dataclass(frozen=True)
class CacheCounters:
    hits: float
    queries: float

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(self.hits - other.hits, self.queries - other.queries)


def counter_sum(text: str, name: str) -> float | None:
    """Sum of every sample of metric `name` (all label sets) in Prometheus text format; None if absent."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1:]  # label values may contain spaces, so skip to the last brace
        elif not rest.startswith(" "):
            continue  # a longer name with this prefix (e.g. ..._created)
        try:
            total += float(rest.split()[0])
            found = True
        except (IndexError, ValueError):
            continue
    return total if found else None


async def scrape(session: aiohttp.ClientSession, urls: list[str], timeout_s: float = 5.0) -> CacheCounters:
    """Fleet-wide counters: the sum over every instance's /metrics. Raises OSError naming a failing URL."""
    texts = await asyncio.gather(*(_fetch(session, u, timeout_s) for u in urls))
    hits = queries = 0.0
    for url, text in zip(urls, texts):
        h, q = counter_sum(text, HITS), counter_sum(text, QUERIES)
        if h is None or q is None:
            raise OSError(f"{url} has no {HITS} / {QUERIES}")
        hits, queries = hits + h, queries + q
    return CacheCounters(hits, queries)


async def _fetch(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise OSError(f"{url} answered HTTP {resp.status}")
            return await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise OSError(f"cannot scrape {url}: {exc.__class__.__name__}") from None
