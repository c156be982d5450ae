"""Running the router: bind, serve on uvloop, shut down gracefully; in-process for tests, forked for workers.

SIGHUP re-reads `backends_file` (discovery.py). Shutdown (SIGTERM or SIGINT): stop accepting, give in-flight requests up to `shutdown_timeout` seconds to
finish, cancel what is left (which closes those upstream connections), exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from warmroute.core import block_hash, prefix_index, strategies
from warmroute.errors import UsageError
from warmroute.router.access_log import JsonAccessLogger, access_logger
from warmroute.router.app import DISCOVERY, PROXY, SETTINGS, build_app
from warmroute.router.metrics import in_worker, share_between_workers, worker_gone
from warmroute.router.settings import RouterSettings
from warmroute.router.shared_index import Links, worker_links

log = logging.getLogger("warmroute.router")


class _NoRequestBytes(logging.Filter):
    """aiohttp's HTTP parser errors quote the bytes they choked on, which can be a prompt (a body read as the
    next request line after a wrong Content-Length): keep the kind of error, drop the bytes and traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            lines = str(exc.message or "").strip().splitlines()
            kind = lines[0].strip().rstrip(":") if lines else type(exc).__name__
            record.msg, record.args = f"{record.getMessage()}: bad HTTP request ({exc.code}, {kind})", None
            record.exc_info = record.exc_text = None
        return True


_PARSER_LOG_FILTER = _NoRequestBytes()


class ServedApp:
    """What a running server's HTTP side is: its aiohttp runner, listening at host:port (the router's, and the
    picker's control surface)."""

    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def app(self) -> web.Application:
        return self.runner.app


@dataclass
class RunningRouter(ServedApp):
    """A router serving inside the current event loop (tests, embedding). `await stop()` when done."""

    runner: web.AppRunner
    host: str
    port: int

    async def stop(self) -> None:
        """Stop accepting; in-flight requests get `shutdown_timeout` seconds, then what is left is cancelled.
        (aiohttp alone waits shutdown_timeout, asks handlers to stop, and waits as long again; a relayed stream
        does not notice being asked, so the router cuts it at the deadline itself.)"""
        app = self.runner.app
        deadline = asyncio.get_running_loop().call_later(app[SETTINGS].shutdown_timeout,
                                                          app[PROXY].cancel_forwarding)
        try:
            await self.runner.cleanup()
        finally:
            deadline.cancel()


async def start_router(settings: RouterSettings, sock: socket.socket | None = None,
                       links: Links | None = None) -> RunningRouter:
    """Start serving in the running loop; with port 0 the kernel picks a free port (see `.port`). `links`: this
    worker's sockets to its sibling workers (index updates, dashboard snapshots)."""
    logging.getLogger("aiohttp.server").addFilter(_PARSER_LOG_FILTER)  # once: filters are a set
    runner = web.AppRunner(build_app(settings, links=links), handler_cancellation=True,  # a client that leaves cancels
                           access_log=access_logger(settings.access_log), access_log_class=JsonAccessLogger,
                           # RunningRouter.stop() cuts forwarded requests at the deadline;
                           shutdown_timeout=settings.shutdown_timeout + 0.5,  # aiohttp's own comes after it
                           keepalive_timeout=settings.client_header_timeout)  # also bounds header reading
    await runner.setup()
    sock = sock or bind(settings)
    site = web.SockSite(runner, sock)
    await site.start()
    return RunningRouter(runner, settings.host, sock.getsockname()[1])


def bind(settings: RouterSettings) -> socket.socket:
    try:
        return socket.create_server((settings.host, settings.port), backlog=1024)
    except OSError as exc:
        raise UsageError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from None


# -- the blocking entry point -------------------------------------------------------------------------------------
def serve(settings: RouterSettings) -> int:
    """Bind (errors are one line, before any worker starts), then serve until SIGTERM/SIGINT."""
    sock = bind(settings)
    if settings.workers == 1:
        return _run_loop(settings, sock)
    return _run_workers(settings, sock)


def _run_loop(settings: RouterSettings, sock: socket.socket, links: Links | None = None) -> int:
    try:
        import uvloop
    except ImportError:  # Windows: the standard loop
        return asyncio.run(_serve_until_signal(settings, sock, links))
    return uvloop.run(_serve_until_signal(settings, sock, links))


async def _serve_until_signal(settings: RouterSettings, sock: socket.socket, links: Links | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await start_router(settings, sock, links)
    if hasattr(signal, "SIGHUP"):
        loop.add_signal_handler(signal.SIGHUP, running.app[DISCOVERY].reload)
    log.info("listening on %s (strategy %s, %d backends, pid %d, block hashes in %s, cost scan in %s, "
             "prefix index in %s)", running.url, settings.strategy, len(settings.backends), os.getpid(),
             "C" if block_hash.NATIVE else "numpy", "C" if strategies._scan is not None else "Python",
             "C" if prefix_index.NATIVE else "Python")
    if not settings.tls_verify:
        log.warning("tls_verify is off: https:// instances' certificates and host names are not checked")
    await stop.wait()
    log.info("shutting down: letting in-flight requests finish (up to %g s)", settings.shutdown_timeout)
    await running.stop()
    return 0


def _run_workers(settings: RouterSettings, sock: socket.socket) -> int:
    """Fork workers that all accept on the one listening socket and share index updates (through Redis when
    `redis_url` is set, else through local sockets); forward SIGTERM/SIGINT to them."""
    ctx = multiprocessing.get_context("fork")  # the sockets are inherited; no event loop exists yet
    sockets = worker_links(settings.workers)  # index updates (unless redis_url) and dashboard snapshots
    metrics_dir = tempfile.mkdtemp(prefix="warmroute-metrics-")  # one /metrics for all workers (metrics.py)
    share_between_workers(metrics_dir)
    workers = [ctx.Process(target=_worker_main, args=(settings, sock, (sockets, i)),
                           name=f"warmroute-worker-{i}")
               for i in range(settings.workers)]
    for w in workers:
        w.start()

    def forward(signum: int, _frame: object) -> None:
        for w in workers:
            if w.pid is not None and w.is_alive():
                os.kill(w.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, forward)
    try:
        for w in workers:
            w.join()
            if w.pid is not None:
                worker_gone(w.pid)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return max((w.exitcode or 0) for w in workers)


def _worker_main(settings: RouterSettings, sock: socket.socket, links: Links | None) -> None:
    in_worker()
    try:
        code = _run_loop(settings, sock, links)
    except UsageError as exc:  # a component that cannot start: one line, as the parent process would say it
        print(f"warmroute serve: error: {exc}", file=sys.stderr)
        code = 2
    raise SystemExit(code)
