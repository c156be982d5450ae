"""A test Kubernetes API (an aiohttp app on loopback): the EndpointSlices of one Service, listed and watched, and
its pods' metadata, patched (JSON merge patch) as the router keeps their deletion costs; and `Stack`, emulated
engines as that Service's pods behind a router that discovers them (tests, benchmarks/autoscale_http.py)."""

from __future__ import annotations

import asyncio
import json
import os
from urllib.parse import urlsplit

from aiohttp import web

from warmroute.engine.model import EngineConfig
from warmroute.engine.server import start_fleet
from warmroute.router.app import ROUTER
from warmroute.router.kubernetes import DELETION_COST
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

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


PODS = "/api/v1/namespaces/llm/pods/{name}"


class FakeApi:
    """GET .../endpointslices: the current list; with ?watch=true, the events put on `events` (None ends the
    watch, as the API server does at timeoutSeconds). PATCH .../pods/NAME: a merge patch of a pod's metadata
    (`pods`, name -> metadata; every patch is also appended to `patches`)."""

    def __init__(self) -> None:
        self.slices: dict[str, dict] = {}
        self.pods: dict[str, dict] = {}
        self.patches: list[tuple[str, dict]] = []
        self.version = 1
        self.events: asyncio.Queue = asyncio.Queue()
        self.lists = 0
        self.selectors: list[str] = []

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get(PATH, self._endpointslices)
        app.router.add_patch(PODS, self._patch_pod)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

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

    async def _patch_pod(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if request.headers.get("Content-Type") != "application/merge-patch+json":
            return web.json_response({"kind": "Status", "code": 415}, status=415)
        if name not in self.pods:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        patch = await request.json()
        self.patches.append((name, patch))
        meta = self.pods[name]
        for k, v in (patch.get("metadata") or {}).get("annotations", {}).items():
            annotations = meta.setdefault("annotations", {})
            if v is None:
                annotations.pop(k, None)
            else:
                annotations[k] = v
        return web.json_response({"apiVersion": "v1", "kind": "Pod", "metadata": meta})

    async def stop(self) -> None:
        await self.runner.cleanup()


def write_kubeconfig(tmp_path, api_url: str, monkeypatch=None) -> None:
    """Point kubernetes-asyncio at the test API (namespace llm), as it would read a user's kubeconfig (the
    variables set through pytest's `monkeypatch`, else for the rest of the process)."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": api_url}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": "llm"}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    if monkeypatch is None:
        os.environ["KUBECONFIG"] = str(kubeconfig)
        os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    else:
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


class Stack:
    """Emulated engines, one pod each in the test Kubernetes API (pods vllm-0.., one EndpointSlice per pod, as
    each engine listens on its own port), and a router (admin token TOKEN) discovering them."""

    TOKEN = "scale-token"

    async def start(self, tmp_path, monkeypatch, count: int, ready: int | None = None, time_scale: float = 0.02,
                    kv_tokens: int = 400_000, **settings) -> Stack:
        self.engines = await start_fleet(count, config=EngineConfig.from_profile("8b", kv_capacity_tokens=kv_tokens),
                                         time_scale=time_scale)
        self.api = FakeApi()
        write_kubeconfig(tmp_path, await self.api.start(), monkeypatch)
        for i in range(count):
            self.api.pods[f"vllm-{i}"] = {"name": f"vllm-{i}", "namespace": "llm"}
        for i in range(ready if ready is not None else count):
            self.set_pod(i)
        self.router = await start_router(load_settings({
            "kubernetes_service": "llm/vllm", "kubernetes_port": "http", "port": 0, "admin_token": self.TOKEN,
            "kv_capacity_tokens": kv_tokens, "health_interval": 0.2, "engine_metrics": False,
            "pod_deletion_cost_interval": 0.5, **settings}, env={}))
        self.url = self.router.url
        self.fleet = self.router.app[ROUTER].fleet
        return self

    def set_pod(self, i: int, terminating: bool = False) -> None:
        port = urlsplit(self.engines.servers[i].url).port
        sl = slice_(f"vllm-{i}", port, endpoint(f"vllm-{i}", "127.0.0.1", terminating=terminating))
        if terminating or f"vllm-{i}" in self.api.slices:
            self.api.change("MODIFIED", sl)
        else:
            self.api.change("ADDED", sl)

    def annotation(self, pod: str) -> int | None:
        value = self.api.pods[pod].get("annotations", {}).get(DELETION_COST)
        return None if value is None else int(value)

    async def stop(self) -> None:
        self.api.events.put_nowait(None)
        await self.router.stop()
        await self.api.stop()
        await self.engines.close()
