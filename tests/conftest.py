"""Fixtures every test module may use: two stand-in instances (fake_upstream.Upstream), an HTTP client, and a
real tokenizer for the emulated engine's tests."""

from __future__ import annotations

import aiohttp
import pytest

from fake_upstream import JSON_TYPE, Upstream
from tokenizer_fixture import write_test_tokenizer
from warmroute.engine.tokenizer import PromptTokenizer


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


@pytest.fixture(scope="session")
def test_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    """A real byte-level BPE tokenizer with a ChatML template, trained once per test session."""
    return PromptTokenizer(write_test_tokenizer(tmp_path_factory.mktemp("tokenizer")))
