"""Retrieval-augmented generation: system prompt, then one or more retrieved documents, then the question.

Documents are drawn by Zipf popularity (some are retrieved far more often), distinct within a request and
in retrieval order, so requests share a prefix up to their first differing document.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from warmroute.workloads.base import Workload
from warmroute.workloads.pool import TextPool
from warmroute.workloads.request import Session, chat_request


@dataclass
class Rag(Workload):
    name: ClassVar[str] = "rag"
    systems: int = 2  # distinct system prompts (one per application)
    system_tokens: int = 100
    docs: int = 32  # documents in the corpus
    doc_tokens: int = 1200
    docs_per_request: int = 1
    question_tokens: int = 40
    zipf: float = 0.5
    at_least_one: ClassVar[tuple[str, ...]] = (*Workload.at_least_one, "systems", "docs", "docs_per_request")

    @cached_property
    def system_pool(self) -> TextPool:
        return TextPool(self.seed, "rag system prompt", self.systems, self.system_tokens, self.zipf)

    @cached_property
    def doc_pool(self) -> TextPool:
        return TextPool(self.seed, "document", self.docs, self.doc_tokens, self.zipf)

    def session(self, rng: random.Random, index: int) -> Session:
        sid = f"{self.name}-{index}"
        system = self.system_pool.text(self.system_pool.draw(rng))
        docs = [self.doc_pool.text(i) for i in self.doc_pool.draw_distinct(rng, self.docs_per_request)]
        user = "Context:\n" + "\n\n".join(docs) + "\n\n" + self.question(rng, sid, self.question_tokens)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        request = chat_request(self.model, messages, tag=self.name, session=sid, max_tokens=self.max_tokens)
        return Session(sid, (request,))

    def working_set_tokens(self, concurrency: int = 1) -> int:
        return self.system_pool.total_tokens + self.doc_pool.total_tokens
