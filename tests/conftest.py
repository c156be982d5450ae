"""Fixtures every test module may use: stand-in instances (fake_upstream.Upstream), an HTTP client, a
real tokenizer for the emulated engine's tests, a kubeconfig pointing at a fake API server, and a
redis-server of the test's own."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from fake_upstream import JSON_TYPE, Upstream
from tokenizer_fixture import write_test_tokenizer
from warmroute.bench.kube_api import write_kubeconfig
from warmroute.bench.processes import Child, free_ports
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
async def stand_ins():
    """Three stand-in instances e0, e1, e2 with no model list (fake_upstream.Upstream)."""
    started = [await Upstream(f"e{i}", models=None).start() for i in range(3)]
    yield started
    for up in started:
        await up.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain client session (the emulated engine's tests)."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def client():
    async with aiohttp.ClientSession(auto_decompress=False, headers=JSON_TYPE) as s:
        yield s


@pytest.fixture(scope="session")
def test_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    """A real byte-level BPE tokenizer with a ChatML template, trained once per test session."""
    return PromptTokenizer(write_test_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture
def kubeconfig(tmp_path, monkeypatch) -> Callable[[str], None]:
    """kubeconfig(api_url): KUBECONFIG names a config whose cluster is the fake API server at api_url
    (namespace `llm`), and the test runs as if outside a cluster."""
    return lambda api_url: write_kubeconfig(tmp_path, api_url, monkeypatch)


@pytest.fixture
async def redis_url(tmp_path):
    """The URL of a redis-server of this test's own; skips, saying what is missing, without one."""
    pytest.importorskip("redis", reason="the redis package is not installed (pip install 'warmroute[redis]')")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
    port = free_ports(1)
    with Child.command("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no"], tmp_path) as redis:
        await redis.wait_for_log("Ready to accept connections", 1, timeout_s=10)
        yield f"redis://127.0.0.1:{port}/0"
