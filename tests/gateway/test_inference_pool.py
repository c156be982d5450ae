"""InferencePool discovery against a fake API server (the pool and its pods, listed and watched): ready pods on
the pool's target ports become instances, others drain, a new selector re-lists the pods."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest
from aiohttp import web

from client_helpers import wait_for
from fake_upstream import Upstream, serve_app
from warmroute.router.app import ROUTER
from warmroute.router.inference_pool import instances_of_pods, pool_targets
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings

pytest.importorskip("kubernetes_asyncio", reason="kubernetes-asyncio is not installed")

POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools"
PODS = "/api/v1/namespaces/llm/pods"


def pool(labels: dict[str, str], *ports: int) -> dict:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "llama", "namespace": "llm"},
            "spec": {"selector": {"matchLabels": labels}, "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"kind": "Service", "name": "warmroute-epp", "port": {"number": 9002},
                                           "failureMode": "FailClose"}}}


def pod(name: str, ip: str, ready: bool = True, app: str = "vllm", deleting: bool = False) -> dict:
    meta = {"name": name, "namespace": "llm", "labels": {"app": app}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_ready_pods_on_each_target_port_become_instances():
    pods = {"a": pod("a", "10.0.0.1"), "b": pod("b", "10.0.0.2", ready=False),
            "c": pod("c", "10.0.0.3", deleting=True)}
    assert pool_targets(pool({"app": "vllm", "tier": "x"}, 8000)) == ("app=vllm,tier=x", (8000,))
    assert [(b.name, b.url) for b in instances_of_pods(pods, (8000,))] == [("a", "http://10.0.0.1:8000")]
    assert [b.name for b in instances_of_pods(pods, (8000, 8001))] == ["a-8000", "a-8001"]


def test_a_pods_llm_d_role_label_gives_its_instance_a_role_in_disaggregated_serving():
    pods = {name: pod(name, f"10.0.0.{i}") for i, name in enumerate(("p", "d", "b", "odd"), 1)}
    for name, role in (("p", "prefill"), ("d", "decode"), ("odd", "leader")):
        pods[name]["metadata"]["labels"]["llm-d.ai/role"] = role
    assert {b.name: b.role for b in instances_of_pods(pods, (8000,))} == \
        {"p": "prefill", "d": "decode", "b": "both", "odd": "both"}


class FakeApi:
    """Lists and watches of the pool and the pods; a list's labelSelector filters pods by their `app` label."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict]] = defaultdict(dict)
        self.events: dict[str, asyncio.Queue] = defaultdict(asyncio.Queue)
        self.queries: dict[str, list[dict]] = defaultdict(list)
        self.version = 1

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get(POOLS, self._serve)
        app.router.add_get(PODS, self._serve)
        self.runner, url = await serve_app(app)
        return url

    def put(self, path: str, kind: str, obj: dict) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        if kind == "DELETED":
            self.objects[path].pop(obj["metadata"]["name"], None)
        else:
            self.objects[path][obj["metadata"]["name"]] = obj
        self.events[path].put_nowait({"type": kind, "object": obj})

    def end_watches(self) -> None:
        for path in (POOLS, PODS):
            self.events[path].put_nowait(None)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.queries[path].append(dict(request.query))
        selector = request.query.get("labelSelector", "")
        wanted = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
        if request.query.get("watch") not in ("true", "True", "1"):
            items = [o for o in self.objects[path].values()
                     if all((o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())]
            return web.json_response({"kind": "List", "metadata": {"resourceVersion": str(self.version)},
                                      "items": items})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while (event := await self.events[path].get()) is not None:
            labels = event["object"]["metadata"].get("labels") or {}
            if all(labels.get(k) == v for k, v in wanted.items()):
                await resp.write(json.dumps(event).encode() + b"\n")
        await resp.write_eof()
        return resp

    async def stop(self) -> None:
        self.end_watches()
        await self.runner.cleanup()


async def test_an_inference_pool_drives_the_fleet(kubeconfig):
    api = FakeApi()
    api_url = await api.start()
    engine = await Upstream("stub", models=None).start()
    kubeconfig(api_url)
    api.objects[POOLS]["llama"] = pool({"app": "vllm"}, engine.port)
    api.objects[PODS]["vllm-0"] = pod("vllm-0", "127.0.0.1")
    api.objects[PODS]["vllm-1"] = pod("vllm-1", "127.0.0.2", ready=False)
    api.objects[PODS]["other"] = pod("other", "127.0.0.9", app="other")
    router = await start_router(load_settings({"inference_pool": "llm/llama", "port": 0, "health_interval": 3600,
                                               "engine_metrics": False, "models_interval": 0}, env={}))
    fleet = router.app[ROUTER].fleet
    try:
        assert set(fleet.instances) == {"vllm-0"}
        await wait_for(lambda: fleet.instances["vllm-0"].healthy)
        assert api.queries[POOLS][0]["fieldSelector"] == "metadata.name=llama"
        assert api.queries[PODS][0]["labelSelector"] == "app=vllm"
        api.put(PODS, "MODIFIED", pod("vllm-1", "127.0.0.2"))  # becomes ready
        await wait_for(lambda: "vllm-1" in fleet.instances)
        api.put(PODS, "MODIFIED", pod("vllm-0", "127.0.0.1", deleting=True))  # terminating: drained
        await wait_for(lambda: set(fleet.instances) == {"vllm-1"})
        api.put(POOLS, "MODIFIED", pool({"app": "other"}, engine.port))  # a new selector: its pods instead
        await wait_for(lambda: set(fleet.instances) == {"other"})
        assert api.queries[PODS][-1]["labelSelector"] == "app=other"
        api.put(POOLS, "DELETED", pool({"app": "other"}, engine.port))  # the pool is gone: nothing left
        await wait_for(lambda: not fleet.instances)
    finally:
        await router.stop()
        await api.stop()
        await engine.stop()


class RecordingCoreApi:
    """CoreV1Api's patch_namespaced_pod, recording the patches (failing for pods in `refuse`)."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, str, dict, str]] = []
        self.refuse: set[str] = set()

    async def patch_namespaced_pod(self, name, namespace, body, _preload_content=True, _content_type=None):
        if name in self.refuse:
            raise RuntimeError("forbidden")
        self.patches.append((name, namespace, body, _content_type))

        class Response:
            async def read(self) -> bytes:
                return b"{}"

        return Response()


async def test_the_pools_pods_get_their_instances_deletion_costs():
    from warmroute.router.inference_pool import InferencePoolDiscovery
    from warmroute.router.kubernetes import DELETION_COST, PodDeletionCost

    source = InferencePoolDiscovery.__new__(InferencePoolDiscovery)  # its pods and ports, without a watch
    source.namespace, source.targets = "llm", ("app=vllm", (8000, 8001))
    source.pods = {"a": pod("a", "10.0.0.1"), "b": pod("b", "10.0.0.2"), "c": pod("c", "10.0.0.3", ready=False)}
    assert source.instance_pods() == {"a-8000": "a", "a-8001": "a", "b-8000": "b", "b-8001": "b"}
    costs = {"a-8000": 5, "a-8001": 9, "b-8000": 1, "b-8001": 0}
    writer, api = PodDeletionCost(source, lambda: costs, 1.0), RecordingCoreApi()
    await writer.update(api)
    assert sorted((n, b["metadata"]["annotations"][DELETION_COST]) for n, _, b, _ in api.patches) == [
        ("a", "9"), ("b", "1")]  # a pod with several ports: its most valuable instance's
    assert {(ns, ct) for _, ns, _, ct in api.patches} == {("llm", "application/merge-patch+json")}
    await writer.update(api)
    assert len(api.patches) == 2  # nothing changed: nothing written
    costs["b-8000"], api.refuse = 3, {"b"}
    await writer.update(api)  # refused: tried again at the next round
    api.refuse = set()
    await writer.update(api)
    assert [(n, b["metadata"]["annotations"][DELETION_COST]) for n, _, b, _ in api.patches[2:]] == [("b", "3")]
