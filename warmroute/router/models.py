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

import aiohttp

from warmroute.core.fleet import Fleet
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


class ModelCatalog:
    def __init__(self, fleet: Fleet, urls: dict[str, str], settings: RouterSettings,
                 adapters: set[str] | None = None) -> None:
        self.fleet = fleet
        # Names of LoRA adapters (vLLM lists each with its base model as `parent`): precise mode seeds an adapter
        # request's token chain with its name, as the engine's KV events name it (Router.lora_adapters).
        self.adapters = adapters if adapters is not None else set()
        self.urls = urls  # shared with the proxy and discovery: the current members
        self.settings = settings
        self.fixed: set[str] = set()  # instances whose models are configured
        for b in settings.backends:
            self.configure(b.name, b.models)

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

    async def refresh_all(self, session: aiohttp.ClientSession) -> None:
        names = [n for n in self.urls if n not in self.fixed]
        got = await asyncio.gather(*(fetch_models(session, self.urls[n], {}, self.settings.health_timeout)
                                     for n in names))
        for name, entries in zip(names, got):
            self.learn(name, entries)

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.settings.models_interval)
            await self.refresh_all(session)
