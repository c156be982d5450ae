"""Fleet membership at run time: the backends file (mtime poll and SIGHUP), DNS re-resolution, the admin API,
and draining. Real HTTP on 127.0.0.1 throughout: stand-in engines, a router started in-process (and once as a
process, for SIGHUP)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from client_helpers import wait_for
from fake_upstream import Upstream
from warmroute.router.app import DISCOVERY, METRICS, PROXY, ROUTER
from warmroute.router.discovery import read_backends_file, with_host
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

TOKEN = "s3cret-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}


def base(**values) -> dict:
    return {"port": 0, "health_interval": 3600, "engine_metrics": False, "models_interval": 0, **values}


# -- the backends file -----------------------------------------------------------------------------------------
def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic, as a config-management tool would
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new mtime even within one tick


def test_read_backends_file_forms(tmp_path):
    f = tmp_path / "b.yaml"
    f.write_text("- a=http://127.0.0.1:1\n- {name: b, url: 'http://127.0.0.1:2', kv_capacity_tokens: 5000}\n")
    assert [(b.name, b.url, b.kv_capacity_tokens) for b in read_backends_file(f)] == [
        ("a", "http://127.0.0.1:1", None), ("b", "http://127.0.0.1:2", 5000)]
    f.write_text("backends: [http://127.0.0.1:3]\n")
    assert [b.url for b in read_backends_file(f)] == ["http://127.0.0.1:3"]
    f.write_text("- 'bad name=http://x:1'\n")
    with pytest.raises(ValueError, match="backends file"):
        read_backends_file(f)
    assert with_host("http://svc.local:8000/v1", "10.0.0.7") == "http://10.0.0.7:8000/v1"
    assert with_host("http://svc.local:8000", "::1") == "http://[::1]:8000"


def test_settings_need_a_source_of_backends(tmp_path):
    from warmroute.errors import UsageError

    with pytest.raises(UsageError, match="at least one backend"):
        load_settings({}, env={})
    assert load_settings({"backends_file": str(tmp_path / "b.yaml")}, env={}).backends == []
    assert load_settings({"admin_token": "x"}, env={}).admin_token.get_secret_value() == "x"
    assert "x" not in repr(load_settings({"admin_token": "x"}, env={}).admin_token)


async def test_backends_file_changes_add_and_drain_instances(tmp_path, stand_ins):
    e0, e1, e2 = stand_ins
    f = tmp_path / "backends.yaml"
    write(f, f"- e1={e1.url}\n")
    router = await start_router(load_settings(base(backends=[f"e0={e0.url}"], backends_file=str(f),
                                                   backends_file_interval=0.05), env={}))
    fleet = router.app[ROUTER].fleet
    try:
        assert set(fleet.instances) == {"e0", "e1"} and all(i.healthy for i in fleet.instances.values())
        write(f, f"- e2={e2.url}\n")  # e1 leaves, e2 joins
        await wait_for(lambda: set(fleet.instances) == {"e0", "e2"} and fleet.instances["e2"].healthy)
        async with aiohttp.ClientSession() as client:
            seen = set()
            for i in range(30):
                body = {**CHAT, "messages": [{"role": "user", "content": f"q{i} " * 300}]}
                async with client.post(router.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    seen.add(r.headers["x-warmroute-instance"])
            assert seen == {"e0", "e2"}
            text = await (await client.get(router.url + "/metrics")).text()
        assert 'warmroute_instance_healthy{backend="e2"} 1.0' in text
        assert 'warmroute_instance_healthy{backend="e1"}' not in text  # gone with the instance
        write(f, "- 'not a backend list\n")  # a broken file keeps the last good list
        await asyncio.sleep(0.3)
        assert set(fleet.instances) == {"e0", "e2"}
    finally:
        await router.stop()


async def test_sighup_rereads_the_backends_file(tmp_path, stand_ins):
    e0, e1, _ = stand_ins
    f = tmp_path / "backends.yaml"
    f.write_text(f"- e0={e0.url}\n")
    env = {**os.environ, "WARMROUTE_BACKENDS_FILE_INTERVAL": "3600", "WARMROUTE_ENGINE_METRICS": "false"}
    env.pop("WARMROUTE_BACKENDS", None)
    with socket_port() as port:
        pass
    proc = subprocess.Popen([sys.executable, "-m", "warmroute", "serve", "--backends-file", str(f),
                             "--port", str(port), "--admin-token", TOKEN], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as client:
            async def names() -> set[str]:
                async with client.get(url + "/admin/instances", headers=AUTH) as r:
                    return {i["name"] for i in (await r.json())["instances"]}

            deadline = time.monotonic() + 20
            while True:
                try:
                    got = await names()
                    break
                except aiohttp.ClientConnectionError:
                    assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read().decode()
                    await asyncio.sleep(0.1)
            assert got == {"e0"}
            f.write_text(f"- e0={e0.url}\n- e1={e1.url}\n")  # the poll interval is an hour: only SIGHUP can tell
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while await names() != {"e0", "e1"}:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


class socket_port:
    """A free port on 127.0.0.1 (closed again before use)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


# -- draining --------------------------------------------------------------------------------------------------
async def test_a_drained_instance_finishes_its_requests_then_leaves(stand_ins):
    e0, e1, _ = stand_ins
    router = await start_router(load_settings(base(backends=[f"e0={e0.url}", f"e1={e1.url}"],
                                                   admin_token=TOKEN, strategy="round_robin"), env={}))
    fleet = router.app[ROUTER].fleet
    try:
        e0.delay = e1.delay = 0.6
        async with aiohttp.ClientSession() as client:
            async def one():
                async with client.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                    return r.status, r.headers["x-warmroute-instance"]

            slow = [asyncio.create_task(one()) for _ in range(4)]
            await wait_for(lambda: fleet.instances["e0"].inflight > 0)
            async with client.post(router.url + "/admin/instances/e0/drain", headers=AUTH) as r:
                assert r.status == 202 and (await r.json())["draining"] is True
            e0.delay = e1.delay = 0.0
            for _ in range(6):  # new requests avoid the draining instance
                assert (await one())[1] == "e1"
            assert "e0" in fleet.instances  # still finishing its own
            results = await asyncio.gather(*slow)
            assert all(status == 200 for status, _ in results) and {n for _, n in results} == {"e0", "e1"}
            await wait_for(lambda: "e0" not in fleet.instances)
            async with client.get(router.url + "/admin/instances", headers=AUTH) as r:
                assert [i["name"] for i in (await r.json())["instances"]] == ["e1"]
    finally:
        await router.stop()


# -- the admin API ---------------------------------------------------------------------------------------------
async def test_admin_api_adds_lists_and_deletes(stand_ins):
    e0, e1, _ = stand_ins
    router = await start_router(load_settings(base(backends=[f"e0={e0.url}"], admin_token=TOKEN), env={}))
    fleet = router.app[ROUTER].fleet
    try:
        async with aiohttp.ClientSession() as client:
            r = await client.post(router.url + "/admin/instances", headers=AUTH,
                                  json={"name": "e1", "url": e1.url, "kv_capacity_tokens": 50000})
            added = await r.json()
            assert r.status == 201 and added["healthy"] is True and added["source"] == "admin"
            assert fleet.instances["e1"].kv_capacity_tokens == 50000
            r = await client.get(router.url + "/admin/instances", headers=AUTH)
            assert {i["name"]: i["url"] for i in (await r.json())["instances"]} == {"e0": e0.url, "e1": e1.url}
            # the new instance takes traffic
            seen = set()
            for i in range(20):
                body = {**CHAT, "messages": [{"role": "user", "content": f"x{i} " * 300}]}
                async with client.post(router.url + "/v1/chat/completions", json=body) as resp:
                    seen.add(resp.headers["x-warmroute-instance"])
            assert seen == {"e0", "e1"}
            # an instance that does not answer joins ejected
            r = await client.post(router.url + "/admin/instances", headers=AUTH,
                                  json={"name": "dead", "url": "http://127.0.0.1:9"})
            assert r.status == 201 and (await r.json())["healthy"] is False
            # conflicts and bad input
            r = await client.post(router.url + "/admin/instances", headers=AUTH, json={"name": "e0", "url": e1.url})
            assert r.status == 409
            for bad in ({"name": "x"}, {"name": "bad name", "url": e1.url}, {"name": "x", "url": "ftp://a"}, [1]):
                r = await client.post(router.url + "/admin/instances", headers=AUTH, json=bad)
                assert r.status == 400, bad
            r = await client.post(router.url + "/admin/instances", headers=AUTH, data=b"{not json")
            assert r.status == 400
            r = await client.delete(router.url + "/admin/instances/e1", headers=AUTH)
            assert r.status == 200 and "e1" not in fleet.instances
            r = await client.delete(router.url + "/admin/instances/e1", headers=AUTH)
            assert r.status == 404
            r = await client.post(router.url + "/admin/instances/nope/drain", headers=AUTH)
            assert r.status == 404
    finally:
        await router.stop()


async def test_admin_api_needs_the_token_and_does_not_exist_without_one(stand_ins):
    e0 = stand_ins[0]
    router = await start_router(load_settings(base(backends=[f"e0={e0.url}"], admin_token=TOKEN), env={}))
    try:
        async with aiohttp.ClientSession() as client:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                            {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
                for method, path in (("GET", "/admin/instances"), ("POST", "/admin/instances"),
                                     ("POST", "/admin/instances/e0/drain"), ("DELETE", "/admin/instances/e0")):
                    async with client.request(method, router.url + path, headers=headers,
                                              json={"name": "z", "url": e0.url}) as r:
                        assert r.status == 401, (method, path, headers)
                        assert r.headers["WWW-Authenticate"].startswith("Bearer")
                        assert TOKEN not in await r.text()
            assert e0.seen == []  # never forwarded to an engine either
        assert set(router.app[ROUTER].fleet.instances) == {"e0"}
    finally:
        await router.stop()

    router = await start_router(load_settings(base(backends=[f"e0={e0.url}"]), env={}))
    try:  # without a token the admin API does not exist, and its paths are not an engine's either
        async with aiohttp.ClientSession() as client:
            for method, path in (("GET", "/admin/instances"), ("POST", "/admin/instances"),
                                 ("DELETE", "/admin/instances/e0"), ("GET", "/admin/anything/else")):
                async with client.request(method, router.url + path, headers={"Authorization": f"Bearer {TOKEN}"},
                                          json={"name": "z", "url": e0.url}) as r:
                    assert r.status == 404, (method, path)
                    assert "admin_token" in (await r.json())["error"]["message"]
        assert e0.seen == []
        assert set(router.app[ROUTER].fleet.instances) == {"e0"}
    finally:
        await router.stop()


# -- DNS --------------------------------------------------------------------------------------------------------
async def test_dns_names_become_one_instance_per_address_and_follow_changes():
    # Engines on 127.0.0.1 and 127.0.0.2 (both loopback on Linux), one port; the resolver is injected.
    first = await Upstream("a1", models=None).start()
    try:
        second = await Upstream("a2", models=None).start(first.port, host="127.0.0.2")
    except OSError:
        await first.stop()
        pytest.skip("127.0.0.2 is not usable here")
    answers = {"engines.test": ["127.0.0.1"]}

    async def resolver(host: str, port: int) -> list[str]:
        return list(answers[host])

    from warmroute.router.app import build_app
    from aiohttp.test_utils import TestServer

    settings = load_settings(base(backends=[f"pool=http://engines.test:{first.port}"],
                                  dns_refresh_interval=0.05), env={})
    server = TestServer(build_app(settings, resolver=resolver), host="127.0.0.1")
    await server.start_server()
    app = server.app
    fleet, urls = app[ROUTER].fleet, app[PROXY].urls  # where the proxy sends each instance's requests
    try:
        assert urls == {"pool": f"http://127.0.0.1:{first.port}"} and fleet.instances["pool"].healthy
        answers["engines.test"] = ["127.0.0.1", "127.0.0.2"]
        await wait_for(lambda: "pool-1" in fleet.instances and fleet.instances["pool-1"].healthy)
        assert urls["pool-1"] == f"http://127.0.0.2:{first.port}"
        async with aiohttp.ClientSession() as client:
            for i in range(20):
                body = {**CHAT, "messages": [{"role": "user", "content": f"d{i} " * 300}]}
                async with client.post(str(server.make_url("/v1/chat/completions")), json=body) as r:
                    assert r.status == 200
        assert first.seen and second.seen
        answers["engines.test"] = ["127.0.0.2"]  # the first address goes: its instance drains away
        await wait_for(lambda: set(fleet.instances) == {"pool-1"})
        answers["engines.test"] = []  # a failed lookup keeps the last addresses
        await asyncio.sleep(0.2)
        assert set(fleet.instances) == {"pool-1"}
        assert 'backend="pool-1"' in app[METRICS].render(fleet)[0].decode()
    finally:
        await server.close()
        await first.stop()
        await second.stop()


async def test_dns_off_by_default_keeps_the_name_in_the_url(stand_ins):
    e0 = stand_ins[0]
    router = await start_router(load_settings(base(backends=[f"e0=http://localhost:{e0.port}"]), env={}))
    try:
        assert router.app[DISCOVERY].membership.urls == {"e0": f"http://localhost:{e0.port}"}
    finally:
        await router.stop()
