"""Deterministic filler text: sentences of common English words, exactly as long as asked.

Prompts are sized in tokens at ≈4 characters per token (the routing key's estimate), so text is generated
to an exact character count. Every generator takes its own `random.Random`, derived from a seed and labels
by `rng_for`, so the same seed gives the same text in every process (string seeds are hashed with SHA-512,
not with Python's per-process salted `hash`).
"""

from __future__ import annotations

import random
from functools import lru_cache

from warmroute.core.routing_key import BYTES_PER_TOKEN

WORDS = (
    "the of and to in is that for it as with was on be by this are from or have an they which one you had "
    "not but what all were when we there can more if no out so said will up other about many then them "
    "these some her would make like him into time has look two write see number way could people than "
    "first water been call who oil its now find long down day did get come made may part over new sound "
    "take only little work know place year live back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any same tell "
    "boy follow came want show also around form three small set put end does another well large must big "
    "even such because turn here why ask went men read need land different home us move try kind hand "
    "picture again change off play spell air away animal house point page letter mother answer found "
    "study still learn should world high every near add food between own below country plant last school "
    "father keep tree never start city earth eye light thought head under story saw left few while along "
    "might close something seem next hard open example begin life always those both paper together got "
    "group often run important until children side feet car mile night walk white sea began grow took "
    "river four carry state once book hear stop without second later miss idea enough eat face watch far "
    "really almost let above girl sometimes mountain cut young talk soon list song being leave family "
    "policy customer account order refund shipping invoice contract service request support product "
    "warranty billing report system model query document section clause summary data record status"
).split()

BLOCK_TOKENS = 512  # Mooncake traces: one hash id per 512-token block
BLOCK_CHARS = BLOCK_TOKENS * BYTES_PER_TOKEN


def chars_for(tokens: int) -> int:
    return max(0, tokens) * BYTES_PER_TOKEN


def rng_for(seed: int, *labels: object) -> random.Random:
    """An RNG for one named part of a workload: independent of every other part, same in every process."""
    return random.Random("/".join(map(str, (seed, *labels))))


def filler(rng: random.Random, n_chars: int) -> str:
    """Sentences of common words, cut to exactly `n_chars` characters (ASCII, so chars == bytes)."""
    parts: list[str] = []
    size = 0
    while size < n_chars:
        sentence = " ".join(rng.choices(WORDS, k=rng.randint(6, 16))).capitalize() + ". "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:n_chars]


@lru_cache(maxsize=1)
def _corpus() -> str:
    """1 MiB of filler, generated once: trace blocks are cut from it instead of generated word by word, which for
    a trace's hundreds of thousands of distinct blocks would take over a minute (docs/tuning.md)."""
    return filler(rng_for(0, "trace-corpus"), 1 << 20)


@lru_cache(maxsize=8192)
def block_text(block_id: int) -> str:
    """The fixed text of one 512-token trace block: the same id always gives the same 2,048 characters.

    It starts with the id, so different ids differ from their first bytes on (no false prefix sharing),
    followed by corpus text from an offset the id picks.
    """
    head = f"[{block_id:x}] "
    corpus = _corpus()
    start = (block_id * 2654435761) % (len(corpus) - BLOCK_CHARS)
    return head + corpus[start:start + BLOCK_CHARS - len(head)]
