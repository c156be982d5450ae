"""OpenAI request options and response shapes for the emulated engine (chat and text completions).

Generated text is deterministic filler: token i is the i-th word of a fixed list, followed by a space.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_TOKENS = 64
SSE_DONE = b"data: [DONE]\n\n"
_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
          "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua")


def filler(start: int, end: int) -> str:
    return "".join(_WORDS[i % len(_WORDS)] + " " for i in range(start, end))


def request_options(body: dict[str, Any]) -> tuple[int, bool]:
    """(max_tokens, stream) of a request body; ValueError for values the engine cannot honour."""
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                      DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError("'max_tokens' must be a positive integer")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError("'stream' must be true or false")
    if body.get("n", 1) not in (1, None):
        raise ValueError("only n=1 is supported")
    return max_tokens, stream


def error_body(message: str, kind: str = "invalid_request_error", code: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class Completion:
    """One response: its id, kind (chat or text) and prompt size; builds the bodies and stream chunks."""

    chat: bool
    model: str
    prompt_tokens: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def request_id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.id}"

    def usage(self, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def response(self, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        text = filler(0, completion_tokens)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._head(stream=False), "choices": [choice],
                "usage": self.usage(completion_tokens, cached_tokens)}

    def token_chunks(self, start: int, end: int) -> bytes:
        """SSE chunks for tokens start..end-1 (one per token; the chat role rides on the first)."""
        return b"".join(sse(self._chunk(filler(i, i + 1), first=i == 0)) for i in range(start, end))

    def closing_chunks(self, completion_tokens: int, cached_tokens: int) -> bytes:
        """The finish_reason chunk, the usage chunk (no choices, as with include_usage) and [DONE]."""
        usage = {**self._head(stream=True), "choices": [], "usage": self.usage(completion_tokens, cached_tokens)}
        return sse(self._chunk(None, finish_reason="length")) + sse(usage) + SSE_DONE

    def _head(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, text: str | None, first: bool = False, finish_reason: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {**self._head(stream=True), "choices": [choice]}
