"""Kubernetes discovery from an InferencePool (setting `inference_pool`; Gateway API Inference Extension, v1).

The pool names its engines by a label selector and their ports (`spec.selector.matchLabels`,
`spec.targetPorts`); this watches the pool and the pods it selects (list, then watch, list again when a watch ends:
router/kubernetes.py's ListWatch), and reconciles the fleet after each change (discovery.py):

  - a pod that is Ready, has an IP and is not being deleted is an instance per target port, named after the pod
    (POD, or POD-PORT when the pool has several ports), at http://POD_IP:PORT;
  - a pod that stops being ready, is being deleted or disappears is drained;
  - a change of the pool's selector or ports restarts the pods' watch with the new ones.

Needs RBAC to get/list/watch inferencepools and pods in the pool's namespace, and to patch the pods for their
deletion costs (kubernetes.py PodDeletionCost; deploy/kubernetes/inference-pool/rbac.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from typing import Any

from warmroute.router.background import cancel_all
from warmroute.router.discovery import Membership, with_host
from warmroute.router.kubernetes import ListWatch, Watcher, apply_event, split_service
from warmroute.router.settings import Backend

log = logging.getLogger("warmroute.router")

SOURCE = "inference-pool"
GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
_BAD_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def pool_targets(pool: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    """(label selector, target ports) of an InferencePool; v1 nests the labels in matchLabels, older versions
    gave the map itself (and one targetPortNumber)."""
    spec = pool.get("spec") or {}
    selector = spec.get("selector") or {}
    labels = selector.get("matchLabels", selector) if isinstance(selector, dict) else {}
    ports = [p.get("number") for p in spec.get("targetPorts") or [] if isinstance(p, dict)]
    if not ports and spec.get("targetPortNumber"):
        ports = [spec["targetPortNumber"]]
    text = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if isinstance(v, str))
    return text, tuple(p for p in ports if isinstance(p, int))


def _ready(pod: dict[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    return bool(status.get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def instances_of_pods(pods: dict[str, dict], ports: tuple[int, ...]) -> list[Backend]:
    """One Backend per ready pod and target port."""
    return [Backend(name=label, url=url, role=role_of(pods[pod])) for label, url, pod in _pod_instances(pods, ports)]


ROLE_LABEL = "llm-d.ai/role"  # llm-d's pod label for disaggregated serving: prefill, decode or both


def role_of(pod: dict[str, Any]) -> str:
    """The pod's part in disaggregated serving, from its ROLE_LABEL (absent or unknown: both)."""
    role = (pod.get("metadata", {}).get("labels") or {}).get(ROLE_LABEL, "both")
    return role if role in ("prefill", "decode", "both") else "both"


def _pod_instances(pods: dict[str, dict], ports: tuple[int, ...]) -> Iterator[tuple[str, str, str]]:
    """(instance name, URL, pod name) per ready pod and target port."""
    for name, pod in sorted(pods.items()):
        if not _ready(pod):
            continue
        for port in ports:
            label = name if len(ports) == 1 else f"{name}-{port}"
            label = _BAD_CHARS.sub("-", label)[:63].strip("-._") or "pod"
            yield label, with_host(f"http://placeholder:{port}", pod["status"]["podIP"]), name


class InferencePoolDiscovery(Watcher):
    name = "inference-pool"

    def __init__(self, membership: Membership, pool: str) -> None:
        super().__init__()
        self.membership = membership
        self.namespace, self.name = split_service(pool)
        self.what = f"InferencePool {self.namespace}/{self.name}"
        self.targets: tuple[str, tuple[int, ...]] | None = None  # (selector, ports) now watched
        self.pods: dict[str, dict] = {}
        self._pods_task: asyncio.Task | None = None

    async def stop(self) -> None:
        await cancel_all([self._pods_task])
        await super().stop()

    async def _run(self) -> None:
        from kubernetes_asyncio import client

        async with client.ApiClient() as api:
            self._core = client.CoreV1Api(api)
            custom = client.CustomObjectsApi(api)
            watched = ListWatch(self.what, custom.list_namespaced_custom_object, self._pools, GROUP, VERSION,
                                self.namespace, PLURAL, on_event=self._pool_event,
                                field_selector=f"metadata.name={self.name}")
            try:
                await watched.run()
            finally:
                await cancel_all([self._pods_task])

    def _pools(self, pools: dict[str, dict]) -> None:
        self._pool_changed(pools.get(self.name))

    def _pool_event(self, kind: str, obj: dict[str, Any]) -> None:
        pools: dict[str, dict] = {}
        if apply_event(pools, kind, obj):
            self._pool_changed(pools.get(self.name))

    def _pool_changed(self, pool: dict[str, Any] | None) -> None:
        targets = pool_targets(pool) if pool is not None else None
        if targets is not None and (not targets[0] or not targets[1]):
            log.warning("kubernetes: %s has no selector or no target ports", self.what)
            targets = None
        if targets == self.targets and (targets is not None or self.synced.is_set()):
            return
        self.targets = targets
        if self._pods_task is not None:
            self._pods_task.cancel()
            self._pods_task = None
        self.pods = {}
        if targets is None:  # gone, or selecting nothing: its instances drain
            self._apply()
            self.synced.set()
            return
        pods = ListWatch(f"pods of {self.what}", self._core.list_namespaced_pod, self._pods_listed, self.namespace,
                         on_event=self._pod_event, label_selector=targets[0])
        self._pods_task = asyncio.create_task(pods.run(), name="warmroute-inference-pool-pods")

    def _pods_listed(self, pods: dict[str, dict]) -> None:
        self.pods = pods
        self._apply()
        self.synced.set()

    def _pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        if apply_event(self.pods, kind, obj):
            self._apply()

    def _ports(self) -> tuple[int, ...]:
        return self.targets[1] if self.targets is not None else ()

    def _apply(self) -> None:
        self.membership.reconcile(SOURCE, instances_of_pods(self.pods, self._ports()))

    def instance_pods(self) -> dict[str, str]:
        """Instance name -> its pod's name (PodDeletionCost)."""
        return {label: pod for label, _, pod in _pod_instances(self.pods, self._ports())}
