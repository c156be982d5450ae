"""Client-side helpers shared by the tests that send requests through a router to emulated engines."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
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
        instance, reason, usage = await read_answer(r, bool(body.get("stream")))
    return Answer(instance, reason, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"])


async def read_answer(r: aiohttp.ClientResponse, streamed: bool) -> tuple[str, str, dict]:
    """(instance, reason, usage) of a successful chat completion: the decision headers and the usage, from the
    JSON body or the stream's last usage chunk."""
    assert r.status == 200, await r.text()
    instance, reason = r.headers["x-warmroute-instance"], r.headers["x-warmroute-reason"]
    if not streamed:
        return instance, reason, (await r.json())["usage"]
    usage = None
    async for line in r.content:
        if line.startswith(b"data: {"):
            usage = json.loads(line[6:]).get("usage") or usage
    return instance, reason, usage


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> None:
    """Poll until `predicate()` holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(interval)
