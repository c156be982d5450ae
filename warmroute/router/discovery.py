"""Who is in the fleet: the static list, a watched backends file, DNS re-resolution, and the admin API.

Every change goes through `Membership`, which tells its followers (members.py: the fleet, metrics, proxy,
health checks, engine scrapes, model catalog, KV-event subscribers) as events:

  - a new instance starts ejected and gets its first health check at once; it takes traffic when that passes;
  - an instance that leaves is *drained*: no new requests, its streams finish, and it is removed once idle
    (`drain`); `remove` drops it at once (the admin API's DELETE): its open streams still finish, uncounted.

Sources, each reconciled on its own (one source never drains another's instances):
  config  `backends` plus `backends_file` (re-read when its mtime changes, and on SIGHUP), each entry expanded
          through DNS when `dns_refresh_interval` > 0: a name with several addresses becomes NAME, NAME-1, ...
          (an address keeps its name for as long as it resolves);
  admin   instances added through POST /admin/instances.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import TypeAdapter, ValidationError

from warmroute.core.fleet import Fleet
from warmroute.errors import UsageError
from warmroute.router.members import Member, MembershipListener
from warmroute.router.settings import Backend, RouterSettings, parse_backends
from warmroute.router.upstream import ServerNames
from warmroute.router.background import cancel_all

log = logging.getLogger("warmroute.router")

CONFIG, ADMIN = "config", "admin"
REAP_INTERVAL = 0.2  # seconds between two looks for drained instances that have gone idle

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """The addresses of a host name, deduplicated, in a stable order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def with_host(url: str, address: str) -> str:
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")


def read_backends_file(path: str | Path, static: Sequence[Backend] = ()) -> list[Backend]:
    """A list of backends (URL, NAME=URL or mappings), bare or under `backends:`; ValueError if unreadable, or if
    a name is repeated, in the file or among the `static` backends (a name is never silently dropped)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read backends file {path}: {str(exc).splitlines()[0]}") from None
    if isinstance(data, dict):
        data = data.get("backends")
    if data is None:
        return []
    try:
        backends = TypeAdapter(list[Backend]).validate_python(parse_backends(data))
    except (ValueError, ValidationError) as exc:
        raise ValueError(f"backends file {path}: {str(exc).splitlines()[0]}") from None
    names = [b.name for b in backends] + [b.name for b in static]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"backends file {path}: backend names must be unique (with --backend too); repeated: "
                         f"{', '.join(dupes)} (a name not given is the URL's host, port and path)")
    return backends


def check_backends_file(settings: RouterSettings) -> None:
    """At start-up, before the port is bound: a backends file that exists must read (UsageError otherwise);
    one that does not exist yet is waited for."""
    if settings.backends_file and os.path.exists(settings.backends_file):
        try:
            read_backends_file(settings.backends_file, settings.backends)
        except ValueError as exc:
            raise UsageError(str(exc)) from None


class FleetMembers:
    """The core's fleet following membership, first of all followers: a new instance takes no traffic until its
    first health check passes. `engine_capacity`: the fleet's (RouterSettings.engine_capacity), for instances
    without their own."""

    def __init__(self, fleet: Fleet, engine_capacity: int | None = None) -> None:
        self.fleet = fleet
        self.engine_capacity = engine_capacity

    def _capacity(self, member: Member) -> int | None:
        own = member.backend.engine_capacity
        return own if own is not None else self.engine_capacity

    def added(self, member: Member) -> None:
        self.fleet.add(member.name, member.backend.kv_capacity_tokens, engine_capacity=self._capacity(member),
                       role=member.backend.role).healthy = False

    def changed(self, member: Member) -> None:
        self.fleet.add(member.name, member.backend.kv_capacity_tokens or None, engine_capacity=self._capacity(member),
                       role=member.backend.role)

    def removed(self, name: str) -> None:
        self.fleet.remove(name)


class Membership:
    """Adds, drains and removes instances, and tells every follower (members.py) of each change.

    `backends`: the configured instances, which the fleet and the metrics were built with; `capacity_configured`
    says whether the user gave a backend's KV capacity (RouterSettings.capacity_configured); `engine_capacity` is
    the fleet's requests per engine at once, if the user gave it."""

    def __init__(self, fleet: Fleet, backends: Sequence[Backend],
                 capacity_configured: Callable[[Backend], bool], engine_capacity: int | None = None) -> None:
        self.fleet = fleet
        self.capacity_configured = capacity_configured
        self.members = {b.name: Member(b, CONFIG, capacity_configured(b)) for b in backends}
        self._listeners: list[MembershipListener] = [FleetMembers(fleet, engine_capacity)]

    def subscribe(self, listener: MembershipListener, replay: bool = True) -> None:
        """Tell `listener` of every change from now on, and (`replay`) of each instance already there as `added`;
        no replay for a follower built with the configured backends (the metrics)."""
        self._listeners.append(listener)
        if replay:
            for member in list(self.members.values()):
                listener.added(member)

    @property
    def urls(self) -> dict[str, str]:
        """A copy of the current instances' base URLs."""
        return {name: m.url for name, m in self.members.items()}

    # -- one instance ------------------------------------------------------------------------------------------
    def add(self, backend: Backend, source: str) -> bool:
        """Add (or update the address of, or cancel the drain of) an instance; False if the name is taken by
        another source."""
        member = self.members.get(backend.name)
        if member is not None and member.source != source:
            return False
        inst = self.fleet.instances.get(backend.name)
        if member is not None and inst is not None:
            if inst.draining:
                log.warning("instance %s rejoins", backend.name)
                inst.draining = False
            member.backend = backend
            for listener in self._listeners:
                listener.changed(member)
            return True
        member = self.members[backend.name] = Member(backend, source, self.capacity_configured(backend))
        log.warning("instance %s joins (%s)", backend.name, source)
        for listener in self._listeners:
            listener.added(member)
        return True

    def drain(self, name: str) -> bool:
        """No new requests; removed once its in-flight requests are done. False if unknown."""
        inst = self.fleet.instances.get(name)
        if inst is None:
            return False
        if not inst.draining:
            log.warning("instance %s draining (%d in flight)", name, inst.inflight)
        inst.draining = True
        self.reap()
        return True

    def remove(self, name: str) -> bool:
        if name not in self.fleet.instances and name not in self.members:
            return False
        self.members.pop(name, None)
        for listener in self._listeners:
            listener.removed(name)
        log.warning("instance %s removed", name)
        return True

    def reap(self) -> None:
        """Remove drained instances that have nothing in flight."""
        for inst in list(self.fleet.instances.values()):
            if inst.draining and inst.inflight == 0:
                self.remove(inst.name)

    # -- a whole source ----------------------------------------------------------------------------------------
    def reconcile(self, source: str, desired: list[Backend]) -> None:
        """Make the source's instances exactly `desired`: add or update those listed, drain the others."""
        wanted = {b.name for b in desired}
        for b in desired:
            if not self.add(b, source):
                log.warning("backend %s from %s ignored: the name is already in use", b.name, source)
        for name, member in list(self.members.items()):
            if member.source == source and name not in wanted:
                self.drain(name)

    def listing(self) -> list[dict[str, Any]]:
        out = []
        for name, inst in self.fleet.instances.items():
            member = self.members.get(name)
            out.append({"name": name, "url": member.url if member else None,
                        "source": member.source if member else CONFIG, "healthy": inst.healthy,
                        "draining": inst.draining, "inflight": inst.inflight,
                        "kv_capacity_tokens": inst.kv_capacity_tokens})
        return out


@dataclass(frozen=True)
class DiscoverySettings:
    backends: list[Backend]
    backends_file: str | None
    backends_file_interval: float
    dns_refresh_interval: float  # 0: names are not resolved by the router

    @classmethod
    def of(cls, s: RouterSettings) -> DiscoverySettings:
        return cls(list(s.backends), s.backends_file, s.backends_file_interval, s.dns_refresh_interval)


class Discovery:
    """A component, the config source: static backends + backends_file, expanded through DNS; its polling loops
    (and the reaper of drained instances, for every source)."""

    name = "discovery"

    def __init__(self, membership: Membership, settings: DiscoverySettings, resolver: Resolver = resolve,
                 server_names: ServerNames | None = None) -> None:
        self.membership = membership
        self.settings = settings
        self.resolver = resolver
        self.server_names = server_names if server_names is not None else {}  # read by the upstream clients
        self._file_mtime: float | None = None
        self._file_backends: list[Backend] = []
        self._dns: dict[str, list[str]] = {}  # configured name -> addresses last resolved
        self._slots: dict[tuple[str, str], str] = {}  # (configured name, address) -> instance name
        self._tasks: list[asyncio.Task] = []
        self._lock = asyncio.Lock()

    @property
    def dns_on(self) -> bool:
        return self.settings.dns_refresh_interval > 0

    async def start(self) -> None:
        """First sync (before the start-up health round), then the loops."""
        await self.refresh(force_file=True, resolve_names=True)
        self._tasks.append(asyncio.create_task(self._reaper(), name="warmroute-drain"))
        if self.settings.backends_file:
            self._tasks.append(asyncio.create_task(self._watch_file(), name="warmroute-backends-file"))
        if self.dns_on:
            self._tasks.append(asyncio.create_task(self._refresh_dns(), name="warmroute-dns"))

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        self._tasks.clear()

    def reload(self) -> asyncio.Task:
        """Re-read the backends file now (SIGHUP)."""
        log.warning("reloading backends (SIGHUP)")
        return asyncio.get_running_loop().create_task(self.refresh(force_file=True))

    async def refresh(self, force_file: bool = False, resolve_names: bool = False) -> None:
        async with self._lock:
            if self.settings.backends_file:
                self._read_file(force_file)
            configured = [*self.settings.backends, *self._file_backends]
            if self.dns_on and resolve_names:
                await self._resolve_all(configured)
            self.membership.reconcile(CONFIG, self._expand(configured))

    # -- the backends file -------------------------------------------------------------------------------------
    def _read_file(self, force: bool) -> None:
        path = self.settings.backends_file
        assert path is not None
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError as exc:
            if force or self._file_mtime is not None:
                log.warning("backends file %s: %s; keeping the last list", path, exc.strerror)
            self._file_mtime = None if force else self._file_mtime
            return
        if not force and mtime == self._file_mtime:
            return
        self._file_mtime = mtime
        try:
            self._file_backends = read_backends_file(path, self.settings.backends)
        except ValueError as exc:
            log.error("%s; keeping the last list", exc)

    async def _watch_file(self) -> None:
        while True:
            await asyncio.sleep(self.settings.backends_file_interval)
            before = self._file_mtime
            try:
                mtime = os.stat(self.settings.backends_file).st_mtime_ns  # type: ignore[arg-type]
            except OSError:
                mtime = None
            if mtime != before:
                await self.refresh(force_file=True, resolve_names=mtime is not None)

    # -- DNS ------------------------------------------------------------------------------------------------------
    async def _resolve_all(self, configured: list[Backend]) -> None:
        async def one(b: Backend) -> None:
            parts = urlsplit(b.url)
            host = parts.hostname or ""
            if is_address(host):
                return
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                addresses = await self.resolver(host, port)
            except (OSError, UnicodeError) as exc:
                log.warning("backend %s: cannot resolve %s (%s); keeping the last addresses", b.name, host, exc)
                return
            if addresses:
                self._dns[b.name] = addresses

        await asyncio.gather(*(one(b) for b in configured))

    async def _refresh_dns(self) -> None:
        while True:
            await asyncio.sleep(self.settings.dns_refresh_interval)
            await self.refresh(resolve_names=True)

    def _expand(self, configured: list[Backend]) -> list[Backend]:
        """One backend per resolved address; an address keeps its instance name while it resolves."""
        if not self.dns_on:
            return configured
        out = []
        for b in configured:
            addresses = self._dns.get(b.name)
            if not addresses:
                out.append(b)  # an address literal, or never resolved: the URL as configured
                continue
            current = {addr: self._slots[b.name, addr] for addr in addresses if (b.name, addr) in self._slots}
            for key in [k for k in self._slots if k[0] == b.name and k[1] not in addresses]:
                del self._slots[key]
            taken = set(current.values()) | set(self.membership.fleet.instances)
            for addr in addresses:
                if addr not in current:
                    name = next(n for n in (b.name, *(f"{b.name}-{i}" for i in range(1, 10_000)))
                                if n not in taken or self._owned_by(b.name, n))
                    current[addr] = self._slots[b.name, addr] = name
                    taken.add(name)
            parts = urlsplit(b.url)
            for addr in addresses:
                if parts.scheme == "https":  # TLS checks the certificate against the name, not the address
                    self.server_names[addr, parts.port or 443] = parts.hostname or ""
                out.append(b.model_copy(update={"name": current[addr], "url": with_host(b.url, addr)}))
        return out

    def _owned_by(self, configured: str, name: str) -> bool:
        """A name free for reuse: an instance of this backend that is not held by any current address."""
        member = self.membership.members.get(name)
        inst = self.membership.fleet.instances.get(name)
        held = name in self._slots.values()
        return (member is not None and member.source == CONFIG and not held
                and (inst is None or not inst.draining) and (name == configured or name.startswith(configured + "-")))

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            self.membership.reap()
