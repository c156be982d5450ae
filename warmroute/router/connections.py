"""The router's clients to its instances, as one component that lives as long as the app (past in-flight
requests): aiohttp's session for the control plane (health checks, engine scrapes, /v1/models, the admin API)
and the leaner UpstreamPool (upstream.py) for proxied requests."""

from __future__ import annotations

import ssl

import aiohttp
from aiohttp import web

from warmroute.core.fleet import Fleet
from warmroute.router.components import Periodic
from warmroute.router.members import Addresses
from warmroute.router.upstream import ServerNames, UpstreamPool


def make_session(tls: ssl.SSLContext | None, connect_timeout: float,
                 server_names: ServerNames | None = None) -> aiohttp.ClientSession:
    """The control plane's client. `tls`: the context for https:// instances (None: the default checks);
    `server_names`: as UpstreamPool's."""
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=0, ssl=True if tls is None else tls,
        keepalive_timeout=4.0,  # below uvicorn's 5 s (vLLM), so we never reuse a connection it is closing
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
        auto_decompress=False,  # relay the bytes as the engine sent them
        skip_auto_headers=("User-Agent", "Accept-Encoding"),  # send only what the client sent
        cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
        middlewares=(_named_tls(server_names),) if server_names is not None else (),
    )


def _named_tls(server_names: ServerNames) -> aiohttp.ClientMiddlewareType:
    """An https:// instance reached by the address its host name resolved to: SNI, certificate check and Host
    header use the name (as UpstreamPool does), not the address."""

    async def middleware(req: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType) -> aiohttp.ClientResponse:
        name = server_names.get((req.url.host or "", req.url.port or 443)) if req.url.scheme == "https" else None
        if name is not None:
            req.server_hostname = name
            req.headers["Host"] = name if req.url.port in (None, 443) else f"{name}:{req.url.port}"
        return await handler(req)

    return middleware




class Upstreams:
    """Both clients; `session` and `pool` exist between start() and stop()."""

    name = "upstream connections"

    def __init__(self, tls: ssl.SSLContext | None, connect_timeout: float, server_names: ServerNames) -> None:
        self.tls, self.connect_timeout = tls, connect_timeout
        self.server_names = server_names  # (address, port) -> host name of https:// instances (DNS discovery)
        self._session: aiohttp.ClientSession | None = None
        self._pool: UpstreamPool | None = None

    @property
    def started(self) -> bool:
        return self._session is not None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the upstream connections are not started"
        return self._session

    @property
    def pool(self) -> UpstreamPool:
        assert self._pool is not None, "the upstream connections are not started"
        return self._pool

    async def start(self) -> None:
        self._session = make_session(self.tls, self.connect_timeout, self.server_names)
        self._pool = UpstreamPool(self.connect_timeout, tls=self.tls, server_names=self.server_names)

    async def stop(self) -> None:
        pool, session, self._pool, self._session = self._pool, self._session, None, None
        if pool is not None:
            await pool.close()
        if session is not None:
            await session.close()


UPSTREAMS = web.AppKey("upstreams", Upstreams)


class Poller(Addresses, Periodic):
    """A component asking every current instance something, at start and every `interval` seconds, through the
    control session; it follows membership (members.py) for their addresses."""

    def __init__(self, fleet: Fleet, upstreams: Upstreams, interval: float) -> None:
        Addresses.__init__(self)
        Periodic.__init__(self, interval)
        self.fleet = fleet
        self.upstreams = upstreams
