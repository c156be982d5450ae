"""Which instances get traffic: active health checks plus passive ejection on what the proxy sees.

Rules (an ejected instance gets no new requests; only a passing health check brings it back):
  - a proxied request that cannot open a connection (refused, connect timeout), or a health check that is
    refused or answered with an error status: eject at once;
  - a 5xx answer to a proxied request, a first-byte timeout, a connection dropped before the answer, or a
    health check that times out: one failure; `failures_before_ejection` consecutive failures eject;
  - any other answer from the instance resets its failure count.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from warmroute.core.fleet import Fleet
from warmroute.router.metrics import Metrics
from warmroute.router.settings import RouterSettings

log = logging.getLogger("warmroute.router")


class Health:
    def __init__(self, fleet: Fleet, urls: dict[str, str], settings: RouterSettings, metrics: Metrics) -> None:
        self.fleet = fleet
        self.urls = urls
        self.settings = settings
        self.metrics = metrics
        self._failures = dict.fromkeys(urls, 0)
        # Set once the first round of checks is done (app.py): an instance that becomes healthy after it joined
        # or recovered while the fleet serves, and ramps up (slow start); those up at start do not.
        self.serving = False

    def is_healthy(self) -> bool:
        return any(i.healthy for i in self.fleet.instances.values())

    # -- passive: what the proxy saw -----------------------------------------------------------------------
    def connection_failed(self, name: str) -> None:
        self._eject(name, "connection failed")

    def upstream_answered(self, name: str, status: int) -> None:
        if status >= 500:
            self.failed(name, f"answered {status}")
        else:
            self._failures[name] = 0

    def failed(self, name: str, why: str) -> None:
        self._failures[name] = self._failures.get(name, 0) + 1
        if self._failures[name] >= self.settings.failures_before_ejection:
            self._eject(name, f"{why} ({self._failures[name]} consecutive failures)")

    # -- active: GET /health on every instance every interval -----------------------------------------------
    async def run(self, session: aiohttp.ClientSession) -> None:
        """Check every interval (the app runs a first round itself before it accepts requests)."""
        while True:
            await asyncio.sleep(self.settings.health_interval)
            await self.check_all(session)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, name) for name in list(self.urls)))

    async def check(self, session: aiohttp.ClientSession, name: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout)
        base = self.urls.get(name)
        if base is None:  # removed from the fleet (discovery) since this round began
            return
        try:
            async with session.get(base + "/health", timeout=timeout) as resp:
                await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ServerTimeoutError):
            self.failed(name, "health check timed out")
            return
        except (aiohttp.ClientError, OSError):
            self._eject(name, "health check could not connect")
            return
        if 200 <= status < 300:
            self._restore(name)
        else:
            self._eject(name, f"health check answered {status}")

    # -- state changes --------------------------------------------------------------------------------------
    def _eject(self, name: str, why: str) -> None:
        inst = self.fleet.instances.get(name)
        if inst is None:
            return
        if inst.healthy:
            log.warning("instance %s ejected: %s", name, why)
        inst.healthy = False
        self.metrics.set_healthy(name, False)

    def _restore(self, name: str) -> None:
        self._failures[name] = 0
        inst = self.fleet.instances.get(name)
        if inst is None:
            return
        if not inst.healthy:
            log.warning("instance %s is healthy again", name)
            if self.serving:
                self.fleet.start_ramp(name, time.monotonic())
        inst.healthy = True
        self.metrics.set_healthy(name, True)
