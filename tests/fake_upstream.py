"""A stand-in inference instance on 127.0.0.1 (records what it receives, answers with an echo or a test's own
behaviour), and a router started in front of such stand-ins: what the router's HTTP tests share."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

from aiohttp import web

from warmroute.router.server import RunningRouter, start_router
from warmroute.router.settings import load_settings

Behaviour = Callable[[web.Request], Awaitable[web.StreamResponse]]
JSON_TYPE = {"Content-Type": "application/json"}  # what clients send; other media types get a 415


class Upstream:
    """A stand-in instance: records what it receives; `behaviour` replaces its default echo answer."""

    def __init__(self, name: str, models: tuple[str, ...] = ("m",)) -> None:
        self.name = name
        self.models = list(models)
        self.health_status = 200
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []  # method, path_qs, headers, body
        self.behaviour: Behaviour | None = None
        self.cancelled = asyncio.Event()  # set when a handler was cut off by its client (the router)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0, ssl_context: ssl.SSLContext | None = None) -> Upstream:
        app = web.Application(client_max_size=64 * 1024**2)  # as large as the router lets through
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._any)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port, ssl_context=ssl_context)
        await site.start()
        self.port = self.runner.addresses[0][1]
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{self.port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status, text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.path_qs, dict(request.headers), b""))
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _any(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, request.raw_path, dict(request.headers), body))
        try:
            if self.behaviour is not None:
                return await self.behaviour(request)
            return web.json_response({"upstream": self.name, "path": request.path, "bytes": len(body)},
                                     headers={"X-Upstream-Name": self.name})
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def settings_for(*upstreams: Upstream, **overrides) -> dict:
    # The stand-ins record every request they get, so no /metrics scrapes (tested in test_engine_signals.py)
    # and no /v1/models reads (test_router_models.py).
    values = {"backends": [f"{u.name}={u.url}" for u in upstreams], "port": 0, "health_interval": 3600,
              "engine_metrics": False, "models_interval": 0}
    values.update(overrides)
    return values


async def router_for(*upstreams: Upstream, **overrides) -> RunningRouter:
    return await start_router(load_settings(settings_for(*upstreams, **overrides), env={}))


CHAT = {"model": "m", "messages": [{"role": "system", "content": "You are terse. " * 20},
                                   {"role": "user", "content": "hi"}]}
