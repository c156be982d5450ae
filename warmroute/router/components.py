"""The router's services as components with one lifecycle: started in order, stopped in reverse.

A component (`Component`) has a `name` and `async start()` / `async stop()`; `stop()` must be safe on a component
whose `start()` failed half way. `Components.start()` starts them in the order given; when one fails, the ones
already started (and the failed one) are stopped in reverse and a UsageError says in one line which and why.
`Components.stop()` stops them in reverse, each within STOP_TIMEOUT_S, logging what fails and going on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

from warmroute.errors import UsageError
from warmroute.router.background import STOP_TIMEOUT_S, cancel_all

log = logging.getLogger("warmroute.router")


class Component(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Components:
    def __init__(self, components: Iterable[Component]) -> None:
        self.components = list(components)
        self._started: list[Component] = []

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components]

    async def start(self) -> None:
        for component in self.components:
            self._started.append(component)  # stopped too if its start fails half way
            try:
                await component.start()
            except asyncio.CancelledError:
                await self.stop()
                raise
            except Exception as exc:
                log.debug("starting %s failed", component.name, exc_info=True)
                await self.stop()
                raise UsageError(f"cannot start {component.name}: {_describe(exc)}") from None

    async def stop(self) -> None:
        while self._started:
            component = self._started.pop()
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await component.stop()
            except TimeoutError:
                log.error("stopping %s took over %g s; left behind", component.name, STOP_TIMEOUT_S)
            except Exception as exc:
                log.error("stopping %s failed: %s", component.name, _describe(exc))


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Periodic:
    """A component doing one round at start (before the router serves, unless not `round_at_start`), then one
    every `interval` seconds until stopped."""

    name = "periodic"
    round_at_start = True

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.running = False  # from the start of start() (its first round included) to stop()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.running = True
        if self.round_at_start:
            await self.round()
        self._task = asyncio.create_task(self._loop(), name=f"warmroute-{self.name}")

    async def stop(self) -> None:
        self.running = False
        task, self._task = self._task, None
        await cancel_all([task])

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.round()

    async def round(self) -> None:
        raise NotImplementedError
