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


class Watcher:
    """A component: a background watch of the Kubernetes API that feeds the fleet; `start` waits (a little) for
    its first listing, so the router knows its instances before it serves."""

    what = "the Kubernetes API"

    def __init__(self) -> None:
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
            log.warning("kubernetes: no %s yet; serving without them", self.what)

    async def stop(self) -> None:
        await cancel_all([self._task])

    async def _run(self) -> None:
        raise NotImplementedError


class KubernetesDiscovery(Watcher):
    name = "kubernetes"

    def __init__(self, membership: Membership, service: str, port: str | None) -> None:
        super().__init__()
        self.membership = membership
        self.namespace, self.service = split_service(service)
        self.what = f"EndpointSlices of {self.namespace}/{self.service}"
        self.port = port
        self.slices: dict[str, dict] = {}
        self.lists = 0  # how many times the slices were listed (tests: a re-list after each watch)

    def _apply(self) -> None:
        self.membership.reconcile(SOURCE, instances_of(self.slices, self.service, self.port))

    async def _run(self) -> None:
        from kubernetes_asyncio import client

        async with client.ApiClient() as api:
            v1 = client.DiscoveryV1Api(api)
            watched = ListWatch(self.what,
                                v1.list_namespaced_endpoint_slice, self._listed, self.namespace,
                                on_event=self._event, label_selector=f"kubernetes.io/service-name={self.service}")
            await watched.run()

    def _listed(self, slices: dict[str, dict]) -> None:
        self.slices = slices
        self.lists += 1
        self._apply()
        self.synced.set()

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        if apply_event(self.slices, kind, obj):
            self._apply()


def apply_event(objects: dict[str, dict], kind: str, obj: dict[str, Any]) -> bool:
    """A watch event into the objects by name; False if it changes nothing (bookmarks, errors)."""
    name = (obj.get("metadata") or {}).get("name")
    if not name or kind not in ("ADDED", "MODIFIED", "DELETED"):
        return False
    if kind == "DELETED":
        objects.pop(name, None)
    else:
        objects[name] = obj
    return True


class ListWatch:
    """List objects, then watch them from that list's resourceVersion; when the watch ends (server timeout,
    dropped connection, 410 Gone) list again, so nothing missed while disconnected is lost. `on_list` gets every
    listing (name -> object), `on_event` every event (type, object); `list_fn(*args, **query)` is a
    kubernetes-asyncio list method."""

    def __init__(self, what: str, list_fn: Any, on_list: Any, *args: Any, on_event: Any = None,
                 watch_seconds: int = WATCH_SECONDS, **query: Any) -> None:
        self.what, self.list_fn, self.on_list, self.args, self.query = what, list_fn, on_list, args, query
        self.on_event = on_event
        self.watch_seconds = watch_seconds

    async def run(self) -> None:
        from kubernetes_asyncio import watch

        failures = 0
        while True:
            try:
                resp = await self.list_fn(*self.args, **self.query, _preload_content=False)
                listing = json.loads(await resp.read())
                objects = {o["metadata"]["name"]: o for o in listing.get("items") or []}
                self.on_list(objects)
                failures = 0
                version = listing.get("metadata", {}).get("resourceVersion")
                async with watch.Watch() as w:
                    stream = w.stream(self.list_fn, *self.args, **self.query, resource_version=version,
                                      timeout_seconds=self.watch_seconds, allow_watch_bookmarks=True)
                    async for event in stream:
                        if self.on_event is not None:
                            self.on_event(event["type"], event.get("raw_object") or {})
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # API errors, 410 Gone, dropped connections: list again
                delay = RETRY_S[min(failures, len(RETRY_S) - 1)]
                failures += 1
                log.warning("kubernetes: watching %s failed (%s); listing again in %g s", self.what,
                            _describe(exc), delay)
                await asyncio.sleep(delay)


def _describe(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    return f"{type(exc).__name__} {status}" if status else type(exc).__name__
