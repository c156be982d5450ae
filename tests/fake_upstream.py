"""The tests' one stand-in inference instance on 127.0.0.1 (records what it receives, answers with an echo or a
test's own behaviour), a router started in front of such stand-ins, and `serve_app` for the other fake
servers (Kubernetes API servers) the tests run."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

from aiohttp import web

from warmroute.router.server import RunningRouter, start_router
from warmroute.router.settings_load import load_settings

Behaviour = Callable[[web.Request], Awaitable[web.StreamResponse]]
JSON_TYPE = {"Content-Type": "application/json"}  # what clients send; other media types get a 415


async def serve_app(app: web.Application, host: str = "127.0.0.1", port: int = 0,
                    ssl_context: ssl.SSLContext | None = None, **runner_options) -> tuple[web.AppRunner, str]:
    """`app` listening on host:port (0: a free port); its runner (`cleanup()` stops it) and base URL."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1, **runner_options)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner, f"{'https' if ssl_context else 'http'}://{host}:{runner.addresses[0][1]}"


DROP = 0  # as Upstream.health_status: /health drops the connection instead of answering


class Upstream:
    """A stand-in instance: /health, /v1/models listing `models` (None: no such route, the path is answered like
    any other), every other path recorded and answered with an echo (after `delay` seconds) or by
    `behaviour`. Bodies are recorded as they arrived (compressed ones are not decompressed)."""

    def __init__(self, name: str, models: tuple[str, ...] | None = ("m",)) -> None:
        self.name = name
        self.models = None if models is None else list(models)
        self.health_status = 200
        self.delay = 0.0
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []  # method, path_qs, headers, body
        self.behaviour: Behaviour | None = None
        self.cancelled = asyncio.Event()  # set when a handler was cut off by its client (the router)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0, ssl_context: ssl.SSLContext | None = None,
                    host: str = "127.0.0.1") -> Upstream:
        app = web.Application(client_max_size=64 * 1024**2)  # as large as the router lets through
        app.router.add_get("/health", self._health)
        if self.models is not None:
            app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._any)
        self.runner, self.url = await serve_app(app, host, port, ssl_context, handler_cancellation=True,
                                                auto_decompress=False)
        self.port = self.runner.addresses[0][1]
        return self

    def paths(self) -> list[str]:
        """The paths (with query) of the requests received, in order."""
        return [path for _, path, _, _ in self.seen]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_status == DROP and request.transport is not None:
            request.transport.close()  # connected, then cut before any answer
        return web.Response(status=self.health_status or 200, text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.path_qs, dict(request.headers), b""))
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _any(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, request.raw_path, dict(request.headers), body))
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.behaviour is not None:
                return await self.behaviour(request)
            return web.json_response({"upstream": self.name, "path": request.path, "bytes": len(body)},
                                     headers={"X-Upstream-Name": self.name})
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def answer_json(body: dict, status: int = 200) -> Behaviour:
    """A behaviour: every request answered with `body` as JSON."""
    async def answer(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)
    return answer


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
