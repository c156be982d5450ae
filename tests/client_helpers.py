"""Client-side helpers shared by the tests that send requests through a router to emulated engines."""

from __future__ import annotations

import json
from typing import NamedTuple

import aiohttp


class Answer(NamedTuple):
    instance: str  # x-warmroute-instance
    reason: str  # x-warmroute-reason
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens, as the engine reported it
    prompt_tokens: int


async def ask(client: aiohttp.ClientSession, url: str, body: dict) -> Answer:
    """One chat completion through the router (streamed or not, as the body says) and its usage."""
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        instance, reason = r.headers["x-warmroute-instance"], r.headers["x-warmroute-reason"]
        if body.get("stream"):
            usage = None
            async for line in r.content:
                if line.startswith(b"data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
        else:
            usage = (await r.json())["usage"]
    return Answer(instance, reason, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"])
