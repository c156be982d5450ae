"""Kubernetes discovery against a fake API server (an aiohttp app serving the EndpointSlice list and watch):
ready endpoints become instances, terminating ones drain, and the slices are listed again after a watch ends."""

from __future__ import annotations

import aiohttp

from client_helpers import wait_for
from fake_upstream import Upstream
from warmroute.bench.kube_api import FakeApi, endpoint, slice_
from warmroute.router.app import ROUTER
from warmroute.router.kubernetes import instances_of
from warmroute.router.server import start_router
from warmroute.router.settings_load import load_settings


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
