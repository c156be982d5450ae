"""Running the picker: the ext_proc and gRPC health services on `epp_port`, the router's control surface on `port`.

The control app is serve's own (router/app.py without its proxy routes): membership from every source (flags,
backends file, DNS, Kubernetes, admin API), health checks, engine scrapes, the shared index, /metrics,
/dashboard. The picker reads the same Router, so the decisions, index and books are serve's.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from warmroute.errors import UsageError
from warmroute.gateway.endpoints import unaddressed
from warmroute.gateway.picker import SERVICE_NAME, Picker
from warmroute.router.admin import MEMBERSHIP
from warmroute.router.app import ACTIVITY, HEALTH, ROUTER, TENANCY, build_app
from warmroute.router.members import Addresses
from warmroute.router.server import ServedApp, bind
from warmroute.router.settings import RouterSettings

log = logging.getLogger("warmroute.gateway")

LIVENESS, READINESS = "liveness", "readiness"
GATEWAY_MARGIN_S = 1.0  # a waiting request's refusal reaches the gateway within this of its deadline (QUEUE_POLL)
_MESSAGE_MARGIN = 1 << 20  # room for the headers and metadata around a body of max_body_bytes
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class RunningPicker(ServedApp):
    """A picker serving inside the current event loop (tests, embedding). `await stop()` when done. Its `url` is
    the control surface: /metrics, /health, /dashboard, /admin."""

    grpc_server: grpc.aio.Server
    health: health.aio.HealthServicer
    runner: web.AppRunner
    picker: Picker
    host: str
    grpc_port: int
    port: int

    @property
    def target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    async def stop(self, grace: float = 0.0) -> None:
        """Readiness goes NOT_SERVING (gateways stop opening streams), open streams get `grace` seconds."""
        for service in (READINESS, SERVICE_NAME):
            await self.health.set(service, _NOT_SERVING)
        await self.grpc_server.stop(grace)
        await self.runner.cleanup()


def check_settings(settings: RouterSettings) -> None:
    """What the picker cannot do, as one line before anything starts. The gateway connects to `ip:port`: an
    instance named by host name needs DNS re-resolution (one instance per address) to have one."""
    if settings.workers != 1:
        raise UsageError("warmroute epp runs one process (workers 1); run more picker replicas with redis_url "
                         "to share their index instead")
    check_gateway_timeouts(settings)
    names = unaddressed({b.name: b.url for b in settings.backends})
    if names and settings.dns_refresh_interval <= 0:
        raise UsageError(f"backend {names[0]} is given by host name, but a gateway needs an address (ip:port): "
                         "give backends by address, or set --dns-refresh-interval so that each name resolves to "
                         "one instance per address")


def check_gateway_timeouts(settings: RouterSettings) -> None:
    """A request may wait in the picker (admission's queue, a hold) only as long as the gateway waits for the
    picker's answer: past the gateway's timeout it answers 503 itself or, failing open, sends the request on to an
    engine past admission, instead of the picker's 429."""
    limit, source = settings.ext_proc_message_timeout, "ext_proc_message_timeout"
    if limit is None and settings.envoy_config is not None:
        limit, source = envoy_message_timeout(settings.envoy_config), f"message_timeout in {settings.envoy_config}"
    if limit is None or not settings.admission.enabled:
        return
    for name, seconds in (("admission.timeout_s", settings.admission.timeout_s),
                          ("hold_timeout", settings.cache_aware.hold_timeout)):
        if seconds + GATEWAY_MARGIN_S > limit:
            raise UsageError(f"{name} ({seconds:g} s) must end at least {GATEWAY_MARGIN_S:g} s before the gateway's "
                             f"ext_proc timeout ({limit:g} s, {source}): a request waiting longer would get the "
                             f"gateway's 503 or, failing open, reach an engine past admission; lower {name} or raise "
                             "the gateway's message_timeout")


def envoy_message_timeout(path: str) -> float | None:
    """The smallest message_timeout of the ext_proc filters in an Envoy configuration (Envoy's default, 0.2 s,
    where one sets none); None if it has no ext_proc filter. A file that cannot be read is a UsageError."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"cannot read envoy_config {path}: {str(exc).splitlines()[0]}") from None
    found: list[float] = []

    def visit(node: object) -> None:
        if isinstance(node, dict):
            typed = node.get("typed_config")
            if node.get("name") == "envoy.filters.http.ext_proc" and isinstance(typed, dict):
                found.append(_duration(typed.get("message_timeout", "0.2s"), path))
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(config)
    return min(found) if found else None


def _duration(value: object, path: str) -> float:
    """A protobuf Duration as Envoy's YAML writes it ("10s", "0.5s") in seconds."""
    text = str(value).strip()
    try:
        return float(text.removesuffix("s"))
    except ValueError:
        raise UsageError(f"envoy_config {path}: ext_proc message_timeout {text!r} is not a duration like 65s") from None


async def start_picker(settings: RouterSettings) -> RunningPicker:
    """Start the control app (its start-up: discovery, the first health round, scrapes), then the gRPC services."""
    check_settings(settings)
    app = build_app(settings, proxying=False)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=settings.shutdown_timeout)
    await runner.setup()
    try:
        sock = bind(settings)
        await web.SockSite(runner, sock).start()
        addresses = Addresses()  # the picker's own map of where each instance is, following membership
        app[MEMBERSHIP].subscribe(addresses)
        picker = Picker(app[ROUTER], app[HEALTH], addresses.urls, settings, app[ACTIVITY], app[TENANCY])
        size = settings.max_body_bytes + _MESSAGE_MARGIN  # a buffered body is one message (and echoed back)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", size),
                                          ("grpc.max_send_message_length", size)])
        ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
        checker = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        grpc_port = server.add_insecure_port(f"{_grpc_host(settings.host)}:{settings.epp_port}")
        if grpc_port == 0:
            raise UsageError(f"cannot listen on {settings.host}:{settings.epp_port} (epp_port)")
        await server.start()
    except BaseException:
        await runner.cleanup()
        raise
    for service in (LIVENESS, READINESS, SERVICE_NAME, ""):
        await checker.set(service, _SERVING)
    return RunningPicker(server, checker, runner, picker, settings.host, grpc_port, sock.getsockname()[1])


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# -- the blocking entry point -------------------------------------------------------------------------------------
def serve(settings: RouterSettings) -> int:
    check_settings(settings)  # errors are one line, before anything starts
    try:
        import uvloop
    except ImportError:  # Windows: the standard loop
        return asyncio.run(_serve_until_signal(settings))
    return uvloop.run(_serve_until_signal(settings))


async def _serve_until_signal(settings: RouterSettings) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await start_picker(settings)
    log.info("endpoint picker on %s (ext_proc and gRPC health), control on %s (strategy %s, %d backends)",
             running.target, running.url, settings.strategy, len(settings.backends))
    await stop.wait()
    log.info("shutting down: letting open streams finish (up to %g s)", settings.shutdown_timeout)
    await running.stop(settings.shutdown_timeout)
    return 0
