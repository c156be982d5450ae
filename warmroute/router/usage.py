"""Reading the engine's cached-token count from a response as it is relayed, without holding any of it back.

Engines report it in the response body: `usage.prompt_tokens_details.cached_tokens` (vLLM, SGLang; in a
stream, in the last chunks when the client asked for usage) and llama.cpp's server `timings.cache_n` (with
`timings.prompt_n`, the prompt tokens it had to compute). A `UsageTap` sees every chunk on its way to the
client, but does real work only from the first `"usage"` or `"timings"` key on: a byte search per chunk, plus
a few bytes kept from the previous chunk so that a key split across two chunks is still found. The captured
bytes (bounded) are parsed once, after the response has been delivered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_USAGE, _TIMINGS = b'"usage"', b'"timings"'
_SEAM = len(_TIMINGS) - 1  # bytes of the previous chunk kept: a split key has at most this many there
MAX_CAPTURE = 16 * 1024  # past this, a new key restarts the capture (e.g. usage in every chunk of a stream)
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class EngineUsage:
    cached_tokens: int
    prompt_tokens: int | None  # in the engine's tokens; None if it did not say


def _first_key(data: bytes) -> int:
    u, t = data.find(_USAGE), data.find(_TIMINGS)
    return u if t < 0 or 0 <= u < t else t


class UsageTap:
    __slots__ = ("_seam", "_capture")

    def __init__(self) -> None:
        self._seam = b""
        self._capture: bytearray | None = None

    def feed(self, chunk: bytes) -> None:
        at = _first_key(chunk)
        if at < 0 and self._seam:
            joined = self._seam + chunk[:_SEAM]  # only a key split across the two chunks can be here
            at_seam = _first_key(joined)
            if at_seam >= 0 and (self._capture is None or len(self._capture) >= MAX_CAPTURE):
                self._capture = bytearray(joined[at_seam:len(self._seam)])
        if at >= 0 and (self._capture is None or len(self._capture) >= MAX_CAPTURE):
            self._capture = bytearray(chunk[at:at + MAX_CAPTURE])
        elif self._capture is not None and len(self._capture) < MAX_CAPTURE:
            self._capture += chunk[:MAX_CAPTURE - len(self._capture)]
        self._seam = chunk[-_SEAM:] if len(chunk) >= _SEAM else (self._seam + chunk)[-_SEAM:]

    def result(self) -> EngineUsage | None:
        """What the engine reported, or None if the response carried no cached-token count."""
        if self._capture is None:
            return None
        return parse_usage(self._capture.decode("utf-8", "replace"))


def parse_usage(text: str) -> EngineUsage | None:
    """The last usage / timings objects in `text` (JSON or SSE events, possibly cut off) -> the report."""
    usage = _last_object(text, '"usage"')
    timings = _last_object(text, '"timings"')
    details = usage.get("prompt_tokens_details") if usage else None
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    prompt = _count(usage.get("prompt_tokens")) if usage else None
    if timings:
        cache_n, prompt_n = _count(timings.get("cache_n")), _count(timings.get("prompt_n"))
        if cached is None:
            cached = cache_n
        if prompt is None and cache_n is not None and prompt_n is not None:
            prompt = cache_n + prompt_n
    if cached is None or (prompt is not None and cached > prompt):
        return None
    return EngineUsage(cached, prompt)


def _last_object(text: str, key: str) -> dict[str, Any] | None:
    """The JSON object that follows the last complete occurrence of `key":` in text."""
    end = len(text)
    while (at := text.rfind(key, 0, end)) >= 0:
        end = at
        colon = at + len(key)
        while colon < len(text) and text[colon] in " \t\r\n":
            colon += 1
        if colon >= len(text) or text[colon] != ":":
            continue
        start = colon + 1
        while start < len(text) and text[start] in " \t\r\n":
            start += 1
        try:
            value, _ = _decoder.raw_decode(text, start)
        except ValueError:  # cut off, or not JSON: try the one before
            continue
        if isinstance(value, dict):
            return value
    return None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
