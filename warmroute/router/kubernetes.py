"""Kubernetes discovery: the engine pods behind a Service, from its EndpointSlices (setting `kubernetes_service`).

List the Service's EndpointSlices (label kubernetes.io/service-name), then watch them from that list's
resourceVersion; when the watch ends (server timeout, dropped connection, 410 Gone) list again, so nothing
missed while disconnected is lost. After every change the set of instances is reconciled (discovery.py):

  - an endpoint that is ready and not terminating is an instance, named after its pod (targetRef), at
    http://ADDRESS:PORT (PORT: the slice's port named or numbered `kubernetes_port`, else its first port);
  - a terminating endpoint, a not-ready one, or one that disappears is drained: no new requests, removed
    once its streams finish.

Needs the `kubernetes-asyncio` package (pip install 'warmroute[kubernetes]'), the in-cluster service account
(or a kubeconfig: $KUBECONFIG, ~/.kube/config), and RBAC to get/list/watch endpointslices in the Service's
namespace (deploy/kubernetes/rbac.yaml).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from warmroute.router.discovery import Membership, with_host
from warmroute.router.settings import Backend
from warmroute.router.background import cancel_all

log = logging.getLogger("warmroute.router")

SOURCE = "kubernetes"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_SECONDS = 300  # the server ends each watch after this; then list again
RETRY_S = (0.5, 1, 2, 5, 10)
_BAD_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def split_service(value: str) -> tuple[str, str]:
    """'NAMESPACE/SERVICE' or 'SERVICE' (the pod's own namespace) -> (namespace, service)."""
    namespace, sep, service = value.rpartition("/")
    if not sep:
        try:
            namespace = NAMESPACE_FILE.read_text().strip()
        except OSError:
            namespace = "default"
    return namespace, service


def instances_of(slices: dict[str, dict], service: str, port: str | None, scheme: str = "http") -> list[Backend]:
    """The ready, not terminating endpoints of all slices, one Backend each."""
    out: dict[str, Backend] = {}
    for sl in slices.values():
        number = _port_of(sl.get("ports") or [], port)
        if number is None:
            continue
        for ep in sl.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue  # per the API, an unknown `ready` counts as ready
            for i, address in enumerate(ep.get("addresses") or []):
                ref = (ep.get("targetRef") or {}).get("name")
                base = ref or f"{service}-{address}"
                name = _BAD_CHARS.sub("-", base if i == 0 else f"{base}-{i}")[:63].strip("-._") or service
                url = with_host(f"{scheme}://placeholder:{number}", address)
                out[name] = Backend(name=name, url=url)
    return list(out.values())


def _port_of(ports: list[dict], wanted: str | None) -> int | None:
    for p in ports:
        if wanted is None or p.get("name") == wanted or str(p.get("port")) == wanted:
            return p.get("port")
    return None


class KubernetesDiscovery:
    def __init__(self, membership: Membership, service: str, port: str | None) -> None:
        self.membership = membership
        self.namespace, self.service = split_service(service)
        self.port = port
        self.slices: dict[str, dict] = {}
        self.lists = 0  # how many times the slices were listed (tests: a re-list after each watch)
        self.synced = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        from kubernetes_asyncio import config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            await config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)  # read now, not at import
        self._task = asyncio.create_task(self._run(), name="warmroute-kubernetes")
        try:  # the first list before serving, unless the API is slow to answer
            async with asyncio.timeout(5.0):
                await self.synced.wait()
        except TimeoutError:
            log.warning("kubernetes: no EndpointSlices of %s/%s yet; serving without them",
                        self.namespace, self.service)

    async def stop(self) -> None:
        await cancel_all([self._task])

    def _apply(self) -> None:
        self.membership.reconcile(SOURCE, instances_of(self.slices, self.service, self.port))

    async def _run(self) -> None:
        from kubernetes_asyncio import client, watch

        selector = f"kubernetes.io/service-name={self.service}"
        failures = 0
        async with client.ApiClient() as api:
            v1 = client.DiscoveryV1Api(api)
            while True:
                try:
                    resp = await v1.list_namespaced_endpoint_slice(self.namespace, label_selector=selector,
                                                                   _preload_content=False)
                    listing = json.loads(await resp.read())
                    self.slices = {s["metadata"]["name"]: s for s in listing.get("items") or []}
                    self.lists += 1
                    self._apply()
                    self.synced.set()
                    failures = 0
                    version = listing.get("metadata", {}).get("resourceVersion")
                    async with watch.Watch() as w:
                        stream = w.stream(v1.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                                          resource_version=version, timeout_seconds=WATCH_SECONDS,
                                          allow_watch_bookmarks=True)
                        async for event in stream:
                            self._event(event["type"], event.get("raw_object") or {})
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # API errors, 410 Gone, dropped connections: list again
                    delay = RETRY_S[min(failures, len(RETRY_S) - 1)]
                    failures += 1
                    log.warning("kubernetes: watching EndpointSlices of %s/%s failed (%s); listing again in %g s",
                                self.namespace, self.service, _describe(exc), delay)
                    await asyncio.sleep(delay)

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if not name or kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = obj
        self._apply()


def _describe(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    return f"{type(exc).__name__} {status}" if status else type(exc).__name__
