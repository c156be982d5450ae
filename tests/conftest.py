"""Fixtures every test module may use: two stand-in instances (fake_upstream.Upstream) and an HTTP client."""

from __future__ import annotations

import aiohttp
import pytest

from fake_upstream import JSON_TYPE, Upstream


@pytest.fixture
async def up_a():
    up = await Upstream("a", ("m", "shared")).start()
    yield up
    await up.stop()


@pytest.fixture
async def up_b():
    up = await Upstream("b", ("other", "shared")).start()
    yield up
    await up.stop()


@pytest.fixture
async def client():
    async with aiohttp.ClientSession(auto_decompress=False, headers=JSON_TYPE) as s:
        yield s
