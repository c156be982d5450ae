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
namespace (deploy/kubernetes/rbac.yaml), and to patch its pods for their deletion costs (PodDeletionCost, setting
`pod_deletion_cost`: a ReplicaSet scaling in then removes the pod whose cache is worth least).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from warmroute.router.components import Periodic
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
    return list({name: Backend(name=name, url=url) for name, url, _ in _endpoints(slices, service, port, scheme)}
                .values())


def pods_of(slices: dict[str, dict], service: str, port: str | None) -> dict[str, str]:
    """Instance name -> the name of its pod, for the instances whose endpoint names one (targetRef)."""
    return {name: pod for name, _, pod in _endpoints(slices, service, port) if pod is not None}


def _endpoints(slices: dict[str, dict], service: str, port: str | None, scheme: str = "http"
               ) -> Iterator[tuple[str, str, str | None]]:
    """(instance name, URL, pod name or None) of every ready, not terminating endpoint address."""
    for sl in slices.values():
        number = _port_of(sl.get("ports") or [], port)
        if number is None:
            continue
        for ep in sl.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue  # per the API, an unknown `ready` counts as ready
            ref = ep.get("targetRef") or {}
            pod = ref.get("name") if ref.get("kind", "Pod") == "Pod" else None
            for i, address in enumerate(ep.get("addresses") or []):
                base = ref.get("name") or f"{service}-{address}"
                name = _BAD_CHARS.sub("-", base if i == 0 else f"{base}-{i}")[:63].strip("-._") or service
                yield name, with_host(f"{scheme}://placeholder:{number}", address), pod


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

    def instance_pods(self) -> dict[str, str]:
        """Instance name -> its pod's name (PodDeletionCost)."""
        return pods_of(self.slices, self.service, self.port)

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


DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
REWRITE_CHANGE = 0.05  # a pod's cost is written again once it moved by more than this share (or the order changed)


def costs_to_write(written: dict[str, int], wanted: dict[str, int]) -> dict[str, int]:
    """The pods whose annotation to (re)write: new ones, and those whose cost moved by more than REWRITE_CHANGE;
    every changed one when the order of the written costs is no longer the order of the wanted ones (the order is
    what a ReplicaSet reads). Costs move with every request: this keeps the writes to the API server few."""
    def order(costs: dict[str, int]) -> list[str]:
        return sorted(wanted, key=lambda p: (costs.get(p, -1), p))

    if order(written) != order(wanted):
        return {p: c for p, c in wanted.items() if written.get(p) != c}
    return {p: c for p, c in wanted.items()
            if p not in written or abs(c - written[p]) > REWRITE_CHANGE * max(written[p], 1)}


class PodSource(Protocol):
    """A discovery that knows its instances' pods (KubernetesDiscovery, InferencePoolDiscovery)."""

    namespace: str

    def instance_pods(self) -> dict[str, str]: ...


class PodDeletionCost(Periodic):
    """A component keeping the deletion-cost annotation of the fleet's pods at what each one's cache is worth
    (`costs`: instance name -> int, router/autoscaling.py), so a ReplicaSet scaling in deletes the pod whose cache
    is worth least: every `interval` seconds, a merge patch for each pod whose cost changed enough since it was
    last written (costs_to_write). Starts after its discovery (which loads the API's configuration). Needs RBAC
    to patch pods (deploy/kubernetes/rbac.yaml, deploy/kubernetes/inference-pool/rbac.yaml)."""

    name = "pod-deletion-cost"
    round_at_start = False  # nothing is worth anything before the first request

    def __init__(self, discovery: PodSource, costs: Callable[[], dict[str, int]], interval: float) -> None:
        super().__init__(interval)
        self.discovery, self.costs = discovery, costs
        self.written: dict[str, int] = {}  # pod -> the cost last written
        self.failing = False  # warned about a failed patch (once until one succeeds)
        self._api: Any = None

    async def start(self) -> None:
        from kubernetes_asyncio import client

        self._api = client.ApiClient()
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        if self._api is not None:
            await self._api.close()

    async def round(self) -> None:
        from kubernetes_asyncio import client

        await self.update(client.CoreV1Api(self._api))

    def wanted(self) -> dict[str, int]:
        """Pod -> its deletion cost now (a pod with several addresses: its most valuable instance's)."""
        costs, out = self.costs(), {}
        for name, pod in self.discovery.instance_pods().items():
            if name in costs:
                out[pod] = max(out.get(pod, 0), costs[name])
        return out

    async def update(self, v1: Any) -> None:
        wanted = self.wanted()
        self.written = {p: c for p, c in self.written.items() if p in wanted}  # pods gone: forgotten
        for pod, cost in costs_to_write(self.written, wanted).items():
            body = {"metadata": {"annotations": {DELETION_COST: str(cost)}}}
            try:
                resp = await v1.patch_namespaced_pod(pod, self.discovery.namespace, body, _preload_content=False,
                                                     _content_type="application/merge-patch+json")
                await resp.read()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # RBAC missing, pod gone, API down: try again next round
                if not self.failing:
                    log.warning("kubernetes: setting the deletion cost of pod %s failed (%s)", pod, _describe(exc))
                self.failing = True
                continue
            self.written[pod] = cost
            self.failing = False
