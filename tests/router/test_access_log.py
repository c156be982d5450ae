"""The access log: one JSON line per request, with the routing decision for proxied ones, for errors too, and
never the prompt, the query string or a header."""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from fake_upstream import CHAT, JSON_TYPE, Upstream, router_for
from warmroute.router.access_log import LOGGER

SECRET = "prompt-text-that-must-not-be-logged"


@pytest.fixture
def lines(caplog):
    logger = logging.getLogger(LOGGER)  # it does not propagate (its lines go alone to stdout): listen on it
    logger.addHandler(caplog.handler)

    def read() -> list[dict]:
        return [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER]
    yield read
    logger.removeHandler(caplog.handler)


async def test_one_json_line_per_request_with_the_decision(lines):
    up = await Upstream("a").start()
    router = await router_for(up, access_log=True)
    try:
        async with aiohttp.ClientSession(headers=JSON_TYPE) as client:
            body = {**CHAT, "messages": [{"role": "user", "content": SECRET * 50}]}
            async with client.post(f"{router.url}/v1/chat/completions?api_key=hunter2", json=body,
                                   headers={"Authorization": "Bearer sk-secret"}) as r:
                assert r.status == 200
                await r.read()
            async with client.post(f"{router.url}/v1/chat/completions", data=b"{not json") as r:
                assert r.status == 400
            async with client.get(f"{router.url}/health") as r:
                assert r.status == 200
    finally:
        await router.stop()
        await up.stop()
    got = lines()
    assert [(x["method"], x["path"], x["status"]) for x in got] == [
        ("POST", "/v1/chat/completions", 200), ("POST", "/v1/chat/completions", 400), ("GET", "/health", 200)]
    proxied, bad, health = got
    assert proxied["instance"] == "a" and proxied["reason"] == "cold" and proxied["attempts"] == 1
    assert proxied["prompt_tokens"] > 100 and proxied["predicted_cached"] == 0.0
    assert 0 <= proxied["ttfb_ms"] <= proxied["ms"] and proxied["bytes"] > 0 and proxied["client"] == "127.0.0.1"
    assert "instance" not in bad and "instance" not in health  # no routing decision was made
    text = "\n".join(json.dumps(x) for x in got)
    assert SECRET not in text and "hunter2" not in text and "sk-secret" not in text


async def test_off_by_default(lines):
    up = await Upstream("a").start()
    router = await router_for(up)
    try:
        async with aiohttp.ClientSession(headers=JSON_TYPE) as client:
            async with client.post(f"{router.url}/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
    finally:
        await router.stop()
        await up.stop()
    assert lines() == []
