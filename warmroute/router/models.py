"""Which models each instance serves, so that a fleet of mixed models (or LoRA adapters on some instances) can
sit behind one router: a request naming a model goes only to the instances that list it (core/fleet.py).

Learnt from each instance's `GET /v1/models` (vLLM lists its served names and loaded LoRA adapters there),
read every `models_interval` seconds and whenever a client asks the router's own /v1/models (with the client's
Authorization, so engines that require an API key are learnt from too), or given per backend in the
configuration (`models:`), which is then never overwritten. A failed read keeps what was known; an instance
never read may serve anything. A model no instance lists is routed as before, to any instance (llama.cpp, for
one, accepts any name).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import aiohttp

from warmroute.core.fleet import Fleet
from warmroute.router.connections import Poller, Upstreams
from warmroute.router.members import Member
from warmroute.router.settings import RouterSettings

log = logging.getLogger("warmroute.router")


async def fetch_models(session: aiohttp.ClientSession, base: str, headers: dict[str, str],
                       timeout_s: float) -> list | None:
    """The `data` list of an instance's /v1/models; None if it could not be read."""
    try:
        async with session.get(base + "/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            data = json.loads(await r.read())
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    return data["data"] if isinstance(data, dict) and isinstance(data.get("data"), list) else None


def model_ids(entries: list) -> frozenset[str]:
    return frozenset(m["id"] for m in entries if isinstance(m, dict) and isinstance(m.get("id"), str))


@dataclass(frozen=True)
class CatalogSettings:
    interval: float  # seconds between two reads of every instance's /v1/models
    timeout: float  # of one read

    @classmethod
    def of(cls, s: RouterSettings) -> CatalogSettings:
        return cls(s.models_interval, s.health_timeout)


class ModelCatalog(Poller):
    """A component (when `models_interval` > 0): reads every instance's /v1/models at start and every interval.
    Follows membership (members.py): an instance's configured `models` are taken as given."""

    name = "models"

    def __init__(self, fleet: Fleet, upstreams: Upstreams, settings: CatalogSettings,
                 adapters: set[str] | None = None) -> None:
        super().__init__(fleet, upstreams, settings.interval)
        # Names of LoRA adapters (vLLM lists each with its base model as `parent`): precise mode seeds an adapter
        # request's token chain with its name, as the engine's KV events name it (Router.lora_adapters).
        self.adapters = adapters if adapters is not None else set()
        self.settings = settings
        self.fixed: set[str] = set()  # instances whose models are configured

    def added(self, member: Member) -> None:
        super().added(member)
        self.configure(member.name, member.backend.models)

    def changed(self, member: Member) -> None:
        super().changed(member)
        self.configure(member.name, member.backend.models)

    def removed(self, name: str) -> None:
        super().removed(name)
        self.fixed.discard(name)

    def configure(self, name: str, models: list[str] | None) -> None:
        if models:
            self.fixed.add(name)
            self.fleet.set_models(name, frozenset(models))

    def learn(self, name: str, entries: list | None) -> None:
        """What an instance's /v1/models said (None: it could not be read, so nothing changes)."""
        if entries is None or name in self.fixed:
            return
        ids = model_ids(entries)
        self.adapters.update(m["id"] for m in entries if isinstance(m, dict) and isinstance(m.get("id"), str)
                             and isinstance(m.get("parent"), str) and m["parent"] != m["id"])
        inst = self.fleet.instances.get(name)
        if ids and inst is not None and inst.models != ids:
            if inst.models is not None:
                log.warning("instance %s now serves %s", name, ", ".join(sorted(ids)))
            self.fleet.set_models(name, ids)

    async def round(self) -> None:
        await self.refresh_all(self.upstreams.session)

    async def refresh_all(self, session: aiohttp.ClientSession) -> None:
        names = [n for n in self.urls if n not in self.fixed]
        got = await asyncio.gather(*(fetch_models(session, self.urls[n], {}, self.settings.timeout)
                                     for n in names))
        for name, entries in zip(names, got):
            self.learn(name, entries)
