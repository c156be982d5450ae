"""Which instances get traffic: active health checks plus passive ejection on what the proxy sees.

Rules (an ejected instance gets no new requests; only a passing health check brings it back):
  - a proxied request whose connection is refused (nothing listens there), or a health check that is refused
    or answered with an error status: eject at once;
  - a 5xx answer to a proxied request, a connect or first-byte timeout, a connection dropped before the answer,
    or a health check that times out: one failure; `failures_before_ejection` consecutive failures eject (an
    overloaded instance is slow, not gone: ejecting it at once moved its load onto the others, or left none);
  - any other answer from the instance resets its failure count;
  - failures never eject the last routable instance (of the fleet, or of a model it serves): slow is better than
    none, as Envoy's outlier detection never ejects past its max_ejection_percent. A refusal still ejects it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from warmroute.core.fleet import Fleet
from warmroute.router.background import cancel_all
from warmroute.router.connections import Poller, Upstreams
from warmroute.router.members import Member
from warmroute.router.metrics import Metrics
from warmroute.router.settings import RouterSettings

log = logging.getLogger("warmroute.router")


@dataclass(frozen=True)
class HealthSettings:
    interval: float  # seconds between two rounds
    timeout: float  # of one check
    failures_before_ejection: int

    @classmethod
    def of(cls, s: RouterSettings) -> HealthSettings:
        return cls(s.health_interval, s.health_timeout, s.failures_before_ejection)


class Health(Poller):
    """A component: a first round before the router serves, then one every interval; a new instance (or a new
    address) is checked at once. Follows membership (members.py) for the addresses it checks."""

    name = "health"

    def __init__(self, fleet: Fleet, upstreams: Upstreams, settings: HealthSettings, metrics: Metrics) -> None:
        super().__init__(fleet, upstreams, settings.interval)
        self.settings = settings
        self.metrics = metrics
        self._failures: dict[str, int] = {}
        self._checks: set[asyncio.Task] = set()
        # Set once the first round is done: an instance that becomes healthy after that joined or recovered while
        # the fleet serves, and ramps up (slow start); those up at start do not.
        self.serving = False

    async def start(self) -> None:
        await super().start()  # the first round
        self.serving = True

    # -- membership ------------------------------------------------------------------------------------------
    def added(self, member: Member) -> None:
        super().added(member)
        self._failures.setdefault(member.name, 0)
        self._check_soon(member.name)

    def changed(self, member: Member) -> None:
        if self.urls.get(member.name) != member.url:
            super().changed(member)
            self._check_soon(member.name)

    def _check_soon(self, name: str) -> None:
        if not self.running:
            return  # not serving yet: the start-up round checks everyone
        task = asyncio.get_running_loop().create_task(self.check(self.upstreams.session, name))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def check_now(self, name: str) -> None:
        """Check one instance and wait for the answer (the admin API answers with its real state)."""
        if self.running:
            await self.check(self.upstreams.session, name)

    async def stop(self) -> None:
        await super().stop()
        await cancel_all(self._checks)

    def is_healthy(self) -> bool:
        return any(i.healthy for i in self.fleet.instances.values())

    # -- passive: what the proxy saw -----------------------------------------------------------------------
    def connection_failed(self, name: str, why: str = "connection refused", timed_out: bool = False) -> None:
        """No connection could be opened to the instance: refused ejects at once, a timeout is one failure."""
        if timed_out:
            self.failed(name, why)
        else:
            self._eject(name, f"connection failed: {why}")

    def upstream_answered(self, name: str, status: int) -> None:
        if status >= 500:
            self.failed(name, f"answered {status}")
        else:
            self._failures[name] = 0

    def failed(self, name: str, why: str) -> None:
        count = self._failures[name] = self._failures.get(name, 0) + 1
        if count < self.settings.failures_before_ejection:
            return
        if self.fleet.sole_server(name):
            if count == self.settings.failures_before_ejection:  # said once per run of failures
                log.warning("instance %s kept although failing (%s): no other instance could take its requests",
                            name, why)
            return
        self._eject(name, f"{why} ({count} consecutive failures)")

    # -- active: GET /health on every instance every interval -----------------------------------------------
    async def round(self) -> None:
        await self.check_all(self.upstreams.session)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, name) for name in list(self.urls)))

    async def check(self, session: aiohttp.ClientSession, name: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout)
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
        except aiohttp.ClientConnectorError:  # nothing listens there (or no route to it)
            self._eject(name, "health check could not connect")
            return
        except (aiohttp.ClientError, OSError) as exc:  # connected, then cut: a busy instance can be slow, not gone
            self.failed(name, f"health check failed: {exc.__class__.__name__}")
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


HEALTH = web.AppKey("health", Health)
