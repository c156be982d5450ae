"""Read the engines' Prometheus /metrics: their prefix-cache counters give the fleet's hit rate; an emulated engine's
also says how far this host made it fall behind its modelled speed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from warmroute.prometheus_text import sample_sum

HITS = "vllm:prefix_cache_hits_total"  # tokens served from the prefix cache
QUERIES = "vllm:prefix_cache_queries_total"  # prompt tokens looked up
BEHIND = "warmroute_emulation_behind_seconds_total"  # an emulated engine's lag on a busy host (others: absent)


@dataclass(frozen=True)
class CacheCounters:
    hits: float
    queries: float
    behind_s: float = 0.0  # summed over the emulated instances: seconds they ran behind their modelled speed

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(self.hits - other.hits, self.queries - other.queries, self.behind_s - other.behind_s)


async def scrape(session: aiohttp.ClientSession, urls: list[str], timeout_s: float = 5.0) -> CacheCounters:
    """Fleet-wide counters: the sum over every instance's /metrics. Raises OSError naming a failing URL."""
    texts = await fetch_metrics(session, urls, timeout_s)
    hits = queries = behind = 0.0
    for url, text in zip(urls, texts):
        h, q = _sum(url, text, HITS), _sum(url, text, QUERIES)
        if h is None or q is None:
            raise OSError(f"{url} has no {HITS} / {QUERIES}")
        hits, queries, behind = hits + h, queries + q, behind + (_sum(url, text, BEHIND) or 0.0)
    return CacheCounters(hits, queries, behind)


def _sum(url: str, text: str, name: str) -> float | None:
    try:
        return sample_sum(text, name)
    except ValueError as exc:
        raise OSError(f"{url} is not Prometheus text: {exc}") from None


async def fetch_metrics(session: aiohttp.ClientSession, urls: list[str], timeout_s: float = 5.0) -> list[str]:
    """Every URL's /metrics page. Raises OSError naming a failing URL."""
    return await asyncio.gather(*(_fetch(session, u, timeout_s) for u in urls))


async def _fetch(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise OSError(f"{url} answered HTTP {resp.status}")
            return await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise OSError(f"cannot scrape {url}: {exc.__class__.__name__}") from None
