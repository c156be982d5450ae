"""Kubernetes discovery against a fake API server (an aiohttp app serving the EndpointSlice list and watch):
ready endpoints become instances, terminating ones drain, and the slices are listed again after a watch ends."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from client_helpers import wait_for
from fake_upstream import Upstream, serve_app
from warmroute.router.app import ROUTER
from warmroute.router.kubernetes import instances_of
from warmroute.router.server import start_router
from warmroute.router.settings import load_settings


PATH = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"


def endpoint(pod: str, address: str, ready: bool = True, terminating: bool = False) -> dict:
    return {"addresses": [address], "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
            "targetRef": {"kind": "Pod", "name": pod, "namespace": "llm"}}


def slice_(name: str, port: int, *endpoints: dict, version: str = "1") -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "llm", "resourceVersion": version,
                         "labels": {"kubernetes.io/service-name": "vllm"}},
            "ports": [{"name": "metrics", "port": 9, "protocol": "TCP"}, {"name": "http", "port": port,
                                                                         "protocol": "TCP"}],
            "endpoints": list(endpoints)}


class FakeApi:
    """GET .../endpointslices: the current list; with ?watch=true, the events put on `events` (None ends the
    watch, as the API server does at timeoutSeconds)."""

    def __init__(self) -> None:
        self.slices: dict[str, dict] = {}
        self.version = 1
        self.events: asyncio.Queue = asyncio.Queue()
        self.lists = 0
        self.selectors: list[str] = []

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get(PATH, self._endpointslices)
        self.runner, url = await serve_app(app)
        return url

    def change(self, kind: str, obj: dict) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        if kind == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        else:
            self.slices[obj["metadata"]["name"]] = obj
        self.events.put_nowait({"type": kind, "object": obj})

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        self.selectors.append(request.query.get("labelSelector", ""))
        if request.query.get("watch") not in ("true", "True", "1"):
            self.lists += 1
            return web.json_response({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                      "metadata": {"resourceVersion": str(self.version)},
                                      "items": list(self.slices.values())})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while True:
            event = await self.events.get()
            if event is None:
                break
            await resp.write(json.dumps(event).encode() + b"\n")
        await resp.write_eof()
        return resp

    async def stop(self) -> None:
        await self.runner.cleanup()


def test_only_ready_endpoints_on_the_named_port_become_instances():
    slices = {"a": slice_("a", 8000, endpoint("vllm-0", "10.0.0.1"), endpoint("vllm-1", "10.0.0.2", ready=False),
                          endpoint("vllm-2", "10.0.0.3", ready=True, terminating=True))}
    got = instances_of(slices, "vllm", "http")
    assert [(b.name, b.url) for b in got] == [("vllm-0", "http://10.0.0.1:8000")]
    assert [b.url for b in instances_of(slices, "vllm", "8000")] == ["http://10.0.0.1:8000"]
    assert [b.url for b in instances_of(slices, "vllm", None)] == ["http://10.0.0.1:9"]  # the first port
    assert instances_of(slices, "vllm", "grpc") == []


async def test_endpointslices_drive_the_fleet(kubeconfig):
    api = FakeApi()
    api_url = await api.start()
    engine = await Upstream("stub", models=None).start()  # every pod is 127.0.0.x on the engine's port
    kubeconfig(api_url)
    api.slices["vllm-abc"] = slice_("vllm-abc", engine.port, endpoint("vllm-0", "127.0.0.1"))
    router = await start_router(load_settings({"kubernetes_service": "llm/vllm", "kubernetes_port": "http",
                                               "port": 0, "health_interval": 3600, "engine_metrics": False},
                                              env={}))
    fleet = router.app[ROUTER].fleet
    try:
        assert set(fleet.instances) == {"vllm-0"} and fleet.instances["vllm-0"].healthy
        assert api.selectors[0] == "kubernetes.io/service-name=vllm"
        async with aiohttp.ClientSession() as client:
            async with client.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x" * 2000}) as r:
                assert r.status == 200 and r.headers["x-warmroute-instance"] == "vllm-0"
        # a second pod becomes ready
        api.change("MODIFIED", slice_("vllm-abc", engine.port, endpoint("vllm-0", "127.0.0.1"),
                                      endpoint("vllm-1", "127.0.0.2")))
        await wait_for(lambda: "vllm-1" in fleet.instances, timeout=10)
        # the first one terminates: drained (idle, so removed at once)
        api.change("MODIFIED", slice_("vllm-abc", engine.port, endpoint("vllm-0", "127.0.0.1", terminating=True),
                                      endpoint("vllm-1", "127.0.0.2")))
        await wait_for(lambda: set(fleet.instances) == {"vllm-1"}, timeout=10)
        # the watch ends; what changes while nobody watches is found by listing again
        lists = api.lists
        api.slices["vllm-def"] = slice_("vllm-def", engine.port, endpoint("vllm-2", "127.0.0.3"))
        api.events.put_nowait(None)
        await wait_for(lambda: api.lists > lists and set(fleet.instances) == {"vllm-1", "vllm-2"}, timeout=10)
        # a deleted slice drains its pods
        api.change("DELETED", api.slices["vllm-def"])
        await wait_for(lambda: set(fleet.instances) == {"vllm-1"}, timeout=10)
    finally:
        api.events.put_nowait(None)
        await router.stop()
        await api.stop()
        await engine.runner.cleanup()
