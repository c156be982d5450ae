"""What a workload emits: requests ready to POST, grouped into sessions whose turns run in order."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from warmroute.core.routing_key import key_for_json

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True, eq=False)  # eq=False: hashable by identity despite the dict body
class WorkloadRequest:
    path: str  # e.g. /v1/chat/completions
    body: dict[str, Any]  # OpenAI-style JSON body, ready to POST (the driver adds streaming options)
    tag: str  # request class, for per-class statistics ("shared", "chat", "rag", "hot", "trace")
    session: str  # id shared by every turn of one conversation
    max_tokens: int
    arrival_s: float | None = None  # offset from the start of the run; None: issue when a driver is free
    turn: int = 0  # position in its session
    tenant: str = ""  # who sends it (the driver's x-tenant header; the router's fair shares): "" for no one

    @cached_property
    def prompt_tokens(self) -> int:
        """Expected prompt tokens, as the router and emulated engine count them (same routing key)."""
        return key_for_json(self.path, self.body).tokens


@dataclass(frozen=True)
class Session:
    """Requests to issue in order: turn k+1 only after turn k has completed (multi-turn chats)."""

    id: str
    requests: tuple[WorkloadRequest, ...]

    @property
    def arrival_s(self) -> float | None:
        return self.requests[0].arrival_s


def chat_request(
    model: str, messages: list[dict[str, str]], *, tag: str, session: str, max_tokens: int, turn: int = 0
) -> WorkloadRequest:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens}
    return WorkloadRequest(CHAT_PATH, body, tag, session, max_tokens, turn=turn)


def completion_request(
    model: str, prompt: str, *, tag: str, session: str, max_tokens: int, arrival_s: float | None = None
) -> WorkloadRequest:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    return WorkloadRequest(COMPLETIONS_PATH, body, tag, session, max_tokens, arrival_s)
