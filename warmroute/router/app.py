"""The router's HTTP surface: which path does what, and the safety net that turns every error into JSON.

  POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/messages, /invocations
                      routed by prefix (routing.py decides, proxy.py forwards)
  FORWARDED_PATHS     the rest of the inference API (/tokenize, score, rerank, pooling...): least loaded
  GET  /v1/models     the healthy instances' model lists, merged
  GET  /health, /ping the router's own health (200 while an instance is healthy, else 503)
  GET  /metrics       Prometheus text
  GET  /livez         200 while the process serves, whatever the engines' state (liveness probes)
  GET  /dashboard     live status page (and /dashboard/state, its JSON), unless `dashboard` is off
  /admin/instances    the admin API (admin.py), only when `admin_token` is set (else /admin/* is a 404)
  anything else       404: an engine's control endpoints (/reset_prefix_cache, /sleep, ...) are never
                      reachable through the router; the admin API fans them out (admin.py)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import aiohttp
from aiohttp import web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from warmroute.core.exact_index import BYTES_PER_BLOCK
from warmroute.core.routing_key import RAW_ROUTES, ROUTED_PATHS
from warmroute.core.strategies import ModelNotServed, NoInstanceAvailable
from warmroute.router import access_log as access
from warmroute.router import dashboard as dash
from warmroute.router.admin import MEMBERSHIP, SIGNALS, add_admin_routes
from warmroute.router.auth import observers_only
from warmroute.router.components import Component, Components, Periodic
from warmroute.router.connections import UPSTREAMS, Upstreams
from warmroute.router.discovery import Discovery, DiscoverySettings, Membership, Resolver, resolve
from warmroute.router.engine_metrics import EngineScraper, ScrapeSettings
from warmroute.router.errors import ApiError, bad_request, json_error, no_instance, too_large
from warmroute.router.health import HEALTH, Health, HealthSettings
from warmroute.router.kv_subscriber import KvEventMetrics, KvEventSources, kv_event_source
from warmroute.router.metrics import NO_INSTANCE, Metrics
from warmroute.router.models import CatalogSettings, ModelCatalog, fetch_models
from warmroute.router.proxy import Proxy
from warmroute.router.routing import SESSION_HEADER, Router
from warmroute.router.settings import RouterSettings, upstream_tls
from warmroute.router.shared_index import Links, SharedIndex, WorkerLinks
from warmroute.router.tenancy import Tenancy, declared_tenants

log = logging.getLogger("warmroute.router")

SETTINGS = web.AppKey("settings", RouterSettings)
ROUTER = web.AppKey("router", Router)
PROXY = web.AppKey("proxy", Proxy)
METRICS = web.AppKey("metrics", Metrics)
SCRAPER = web.AppKey("scraper", EngineScraper)
DISCOVERY = web.AppKey("discovery", Discovery)
ACTIVITY = web.AppKey("activity", dash.Activity)
SIBLINGS = web.AppKey("siblings", dash.Siblings)  # the other workers' dashboard snapshots
TIMELINE = web.AppKey("timeline", dash.Timeline)  # the dashboard's charts: a bounded ring of points
CATALOG = web.AppKey("catalog", ModelCatalog)  # which models each instance serves
SERVER_NAMES = web.AppKey("server_names", dict)  # (address, port) -> host name of https:// instances (DNS)
KV_EVENTS = web.AppKey("kv_events", object)  # KvEventSources | None: precise mode's subscribers
COMPONENTS = web.AppKey("components", Components)  # what starts with the app and stops with it, in order
TENANCY = web.AppKey("tenancy", Tenancy)  # who a request's tenant is, and its priority class

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The inference API that carries no prompt to route on (vLLM's and the OpenAI API's names): forwarded to the
# least-loaded instance. Every other path is a 404, never forwarded.
FORWARDED_PATHS = frozenset({
    "/tokenize", "/detokenize", "/v1/messages/count_tokens",
    "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/pooling", "/classify",
    "/v1/audio/transcriptions", "/v1/audio/translations",
})
# Content-Encoding of request bodies that aiohttp decompresses as it reads them (brotli and zstd only where
# their packages are installed); the body then goes upstream decompressed, without the header.
_DECODED = {"", "identity", "gzip", "deflate"} | ({"br"} if HAS_BROTLI else set()) | ({"zstd"} if HAS_ZSTD else set())


# -- handlers -------------------------------------------------------------------------------------------------
async def proxied(request: web.Request) -> web.StreamResponse:
    """Every proxied path: read the body, decide, forward."""
    app = request.app
    _check_content_headers(request)
    body = await _read_body(request, app[SETTINGS].max_body_bytes, app[SETTINGS].idle_timeout)
    router = app[ROUTER]
    session = request.headers.get(SESSION_HEADER)
    key = await router.key_off_loop(request.path, body, session)
    parsed = await router.tokenize_ahead(request.path, body) if key is None and router.tokenizer is not None else None
    life = router.open()
    key, decision = router.route(request.path, body, session, key, parsed)
    life.keyed(key, *app[TENANCY].who(request.headers, key))
    if router.fleet.disaggregated:  # a prefill and a decode leg, or whole to a decode instance
        plan = router.split(request.path, key, decision)
        first, waited = await router.admit(life, plan.first, len(body), pool=plan.pool)
        plan = router.replan(plan, first)
        decision = plan.decode
    else:
        plan = None
        decision, waited = await router.admit(life, decision, len(body))  # no room at its instance: it waits here
    if waited:
        request[access.WAITED] = waited
    app[ACTIVITY].note(key, decision)
    return await app[PROXY].forward(request, body, life, decision, plan)


def _check_content_headers(request: web.Request) -> None:
    """415 for a body the router cannot read as the route requires: an encoding aiohttp does not decode, or
    (on a JSON route) a media type that is not JSON; no Content-Type at all is taken as JSON, as engines do."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in _DECODED:
        raise ApiError(415, f"unsupported Content-Encoding {encoding[:40]!r}; supported: "
                            f"{', '.join(sorted(e for e in _DECODED if e))}")
    if request.path in ROUTED_PATHS and request.path not in RAW_ROUTES and request.method == "POST":
        media = request.headers.get("Content-Type", "application/json").partition(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise ApiError(415, f"Content-Type must be application/json on {request.path}, not {media[:60]!r}")


async def _read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """The whole body (decompressed, if it came compressed), with at most `timeout` seconds between two of
    its pieces: a slow upload is fine, a stalled one is not."""
    if request.content_length is not None and request.content_length > limit and \
            "Content-Encoding" not in request.headers:
        raise too_large(limit)  # refuse before reading it
    try:
        if request.content.is_eof():  # the whole body arrived with the headers (the usual case): no timer
            return await request.read()  # aiohttp enforces client_max_size (= limit), decompressed too
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(loop.time() + timeout) as gap:
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
                gap.reschedule(loop.time() + timeout)
        return b"".join(chunks)
    except TimeoutError:
        raise ApiError(408, f"request body stalled: nothing received for idle_timeout ({timeout:g} s)") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limit) from None
    except (aiohttp.ClientPayloadError, HttpProcessingError, RequestPayloadError):  # cut short, or undecodable
        raise bad_request("request body was cut short or malformed") from None


async def models(request: web.Request) -> web.Response:
    """The union of the healthy instances' /v1/models lists, each model once (also what each one serves: the
    catalog learns it here too, with the client's credentials)."""
    urls, fleet = request.app[PROXY].urls, request.app[ROUTER].fleet
    names = [n for n, i in fleet.instances.items() if i.healthy and n in urls]
    if not names:
        raise no_instance(request.app[SETTINGS].health_interval)
    auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    session = request.app[UPSTREAMS].session
    timeout = request.app[SETTINGS].health_timeout  # as light as a health check
    lists = await asyncio.gather(*(fetch_models(session, urls[n], auth, timeout) for n in names))
    seen: dict[str, dict] = {}
    learn = request.app[SETTINGS].models_interval > 0  # 0: what instances serve is never read, so never narrows
    for name, entries in zip(names, lists):
        if learn:
            request.app[CATALOG].learn(name, entries)
        for m in entries or ():
            if isinstance(m, dict) and isinstance(m.get("id"), str):
                seen.setdefault(m["id"], m)
    if not seen and not any(lists):
        raise ApiError(502, "no instance answered /v1/models", "upstream_error")
    return web.json_response({"object": "list", "data": list(seen.values())})


async def health(request: web.Request) -> web.Response:
    fleet = request.app[ROUTER].fleet
    healthy = [n for n, i in fleet.instances.items() if i.healthy]
    status = 200 if healthy else 503
    return web.json_response({"status": "ok" if healthy else "unavailable", "healthy_instances": len(healthy),
                              "instances": len(fleet.instances)}, status=status)


async def ping(request: web.Request) -> web.Response:
    """SageMaker's health probe: an empty 200 while the router can serve."""
    return web.Response(status=200 if request.app[HEALTH].is_healthy() else 503)


async def livez(request: web.Request) -> web.Response:
    """Liveness: the event loop answers. Never depends on the engines (that is /health's job). `pid` tells
    which worker process answered (`workers` > 1)."""
    return web.json_response({"status": "alive", "pid": os.getpid()})


def unknown_path() -> ApiError:
    """A path outside the inference API: never forwarded (an engine's control endpoints live on such paths)."""
    return ApiError(404, "unknown path: the router forwards only the inference API (/v1/chat/completions, "
                         "/v1/completions, /v1/messages, /invocations, ...)", "not_found_error")


async def not_found(request: web.Request) -> web.Response:
    raise unknown_path()


async def admin_off(request: web.Request) -> web.Response:
    """/admin/* without `admin_token`: the router's own path, so a 404 here, never a request to an engine."""
    raise ApiError(404, "the admin API is off: set admin_token (--admin-token, WARMROUTE_ADMIN_TOKEN) to use it",
                   "not_found_error")


async def dashboard_state(request: web.Request) -> web.Response:
    app = request.app
    state = dash.state(app[ROUTER].fleet, app[ACTIVITY], app[METRICS], app[SETTINGS].strategy,
                       app[SIBLINGS].fresh(), app[ROUTER].admission, app[TIMELINE])
    return web.json_response(state, headers={"Cache-Control": "no-store"})


def refresh_demand(app: web.Application) -> None:
    """The demand gauges from the router's books now (at each scrape, and every second in a worker of several, so
    that the workers' sums are fresh whichever of them answers the scrape)."""
    signals = app[ROUTER].signals
    demand = signals.by_model()

    def desired_of(model: str, ratio: float) -> int | None:
        return signals.desired_for(demand[model].current, ratio) if model in demand else None

    app[METRICS].set_demand({m: (d.demand, d.desired) for m, d in demand.items()}, desired_of)


async def metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    refresh_demand(request.app)
    body, content_type = await request.app[METRICS].exposition(router.fleet)
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = content_type
    return resp


# -- the safety net ---------------------------------------------------------------------------------------------
@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """No traceback ever reaches a client, and one bad request never affects another."""
    request[access.STARTED] = time.perf_counter()  # the access log's clock (uvloop's own has 1 ms steps)
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(request, exc)
    except NoInstanceAvailable as exc:
        model = exc.model if isinstance(exc, ModelNotServed) else None
        return _error(request, no_instance(request.app[SETTINGS].health_interval, model))
    except web.HTTPException as exc:  # aiohttp's own (e.g. 405): same JSON shape
        if exc.status < 400:
            raise
        return _error(request, ApiError(exc.status, exc.reason, "invalid_request_error"))
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client is gone; nothing to answer
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)  # path only, never the body
        return _error(request, ApiError(500, "internal router error", "internal_error"))


def _error(request: web.Request, exc: ApiError) -> web.Response:
    request.app[METRICS].answered(exc.instance, exc.status)
    headers = dict(exc.headers)
    if exc.instance != NO_INSTANCE and request.app[SETTINGS].decision_headers:
        headers["x-warmroute-instance"] = exc.instance
    return json_error(exc.status, exc.message, exc.kind, headers)


# -- assembly -------------------------------------------------------------------------------------------------
def build_app(settings: RouterSettings, resolver: Resolver = resolve, links: Links | None = None,
              proxying: bool = True) -> web.Application:
    """The router's app; without `proxying`, only its control surface (metrics, health, dashboard, admin API):
    `warmroute epp`, where a gateway carries the requests and the app keeps the fleet."""
    app = web.Application(middlewares=[json_errors], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[TENANCY] = tenancy = Tenancy(settings)
    app[METRICS] = metrics_ = Metrics(settings.strategy, [b.name for b in settings.backends], tenancy.classes.labels,
                                      declared_tenants(settings))
    app[ROUTER] = router = Router(settings, metrics_)
    app[SIGNALS] = router.signals
    app[SERVER_NAMES] = server_names = {}
    app[UPSTREAMS] = upstreams = Upstreams(upstream_tls(settings), settings.connect_timeout, server_names)
    app[HEALTH] = health_ = Health(router.fleet, upstreams, HealthSettings.of(settings), metrics_)
    app[PROXY] = proxy = Proxy(router, health_, upstreams, settings)
    app[SCRAPER] = scraper = EngineScraper(router.fleet, upstreams, ScrapeSettings.of(settings), metrics_,
                                           router.admission.limit if settings.admission.enabled else None)
    app[CATALOG] = catalog = ModelCatalog(router.fleet, upstreams, CatalogSettings.of(settings), router.lora_adapters)
    app[KV_EVENTS] = kv_events = _kv_events(settings, router, metrics_, upstreams)
    app[MEMBERSHIP] = membership = Membership(router.fleet, settings.backends, settings.capacity_configured,
                                              settings.engine_capacity)
    membership.subscribe(metrics_, replay=False)  # built with the configured backends, as the fleet was
    for follower in (catalog, scraper, kv_events, proxy, health_):  # health last: it checks a new instance
        if follower is not None:
            membership.subscribe(follower)
    app[DISCOVERY] = Discovery(membership, DiscoverySettings.of(settings), resolver, server_names)
    app[ACTIVITY] = dash.Activity(settings.block_bytes)
    app[SIBLINGS] = dash.Siblings()
    app[TIMELINE] = dash.Timeline()
    app[COMPONENTS] = _components(app, links)
    app.cleanup_ctx.append(_lifetime)

    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", ping)
    observers = settings.observability_token.get_secret_value() if settings.observability_token else None
    app.router.add_get("/metrics", observers_only(metrics, observers))
    app.router.add_get("/livez", livez)
    if settings.dashboard:
        app.router.add_get("/dashboard", observers_only(dash.page, observers))
        app.router.add_get("/dashboard/state", observers_only(dashboard_state, observers))
    if settings.admin_token is not None:
        add_admin_routes(app, settings.admin_token.get_secret_value())
    else:  # never forward the router's own admin paths to an engine
        app.router.add_route("*", "/admin/{tail:.*}", admin_off)
    if proxying:
        for path in sorted(ROUTED_PATHS | FORWARDED_PATHS):  # plain routes: found by a dict lookup
            app.router.add_route("*", path, proxied)
    app.router.add_route("*", "/{tail:.*}", not_found)  # everything else
    return app


def _kv_events(settings: RouterSettings, router: Router, metrics_: Metrics,
               upstreams: Upstreams) -> KvEventSources | None:
    """Precise mode's subscribers (one per instance, following membership); None in any other mode."""
    if router.exact is None:
        return None
    return KvEventSources(router.exact, KvEventMetrics(metrics_.registry), settings.kv_events_topic,
                          settings.index_memory_bytes // BYTES_PER_BLOCK, partial(kv_event_source, settings), upstreams)


def _components(app: web.Application, links: Links | None) -> Components:
    """The services, in the order they start (and stop in reverse): the connections first; the sources of
    instances (KV events follow them, so first) before the first health round; the index shared with the other
    replicas or workers; then the rounds that need every instance known."""
    settings, router = app[SETTINGS], app[ROUTER]
    items: list[Component | None] = [app[UPSTREAMS], app[KV_EVENTS], app[DISCOVERY]]
    pods: list = []  # the Kubernetes sources, whose pods get their deletion costs
    if settings.kubernetes_service:
        from warmroute.router.kubernetes import KubernetesDiscovery

        pods.append(KubernetesDiscovery(app[MEMBERSHIP], settings.kubernetes_service, settings.kubernetes_port))
    if settings.inference_pool:
        from warmroute.router.inference_pool import InferencePoolDiscovery

        pods.append(InferencePoolDiscovery(app[MEMBERSHIP], settings.inference_pool))
    items += pods
    if pods and settings.pod_deletion_cost:  # following what their caches are worth
        from warmroute.router.kubernetes import PodDeletionCost

        items += [PodDeletionCost(p, app[SIGNALS].deletion_costs, settings.pod_deletion_cost_interval) for p in pods]
    redis = None  # index updates to and from the other replicas
    if settings.redis_url is not None:
        redis = SharedIndex(settings.redis_url.get_secret_value(), settings.redis_channel, router.fleet)
    # a worker of `workers` > 1: the others' index updates (without Redis) and dashboard snapshots
    siblings = None if links is None else WorkerLinks(router.fleet, *links, share_index=redis is None,
                                                      on_snapshot=app[SIBLINGS].receive)
    router.shared = redis if redis is not None else siblings  # sends nothing until started
    items += [redis, siblings, app[HEALTH]]
    if siblings is not None and settings.dashboard:
        items.append(SnapshotSender(app, siblings))
    if settings.dashboard:
        items.append(dash.TimelineSampler(app[TIMELINE], router.fleet, app[ACTIVITY], app[METRICS], app[SIBLINGS],
                                          router.admission))
    if siblings is not None:  # the other workers' scrapes sum this one's demand: keep it fresh
        items.append(DemandRefresh(app))
    if settings.models_interval > 0:  # which instance serves which model, before the first request
        items.append(app[CATALOG])
    if settings.engine_metrics:  # and each engine's KV capacity, where not configured
        items.append(app[SCRAPER])
    return Components(c for c in items if c is not None)


class SnapshotSender(Periodic):
    """Every second, this worker's dashboard figures to the other workers (dashboard.py)."""

    name = "dashboard-snapshots"
    round_at_start = False

    def __init__(self, app: web.Application, links: WorkerLinks) -> None:
        super().__init__(dash.SNAPSHOT_EVERY_S)
        self.app, self.links = app, links

    async def round(self) -> None:
        app = self.app
        snap = dash.snapshot(app[ROUTER].fleet, app[ACTIVITY], app[METRICS], app[ROUTER].admission)
        self.links.send_snapshot(json.dumps(snap, separators=(",", ":")).encode())


class DemandRefresh(Periodic):
    """Every second, this worker's demand gauges (refresh_demand), which a scrape answered by another sums."""

    name = "demand-refresh"
    round_at_start = False

    def __init__(self, app: web.Application) -> None:
        super().__init__(1.0)
        self.app = app

    async def round(self) -> None:
        refresh_demand(self.app)


async def _lifetime(app: web.Application) -> AsyncIterator[None]:
    """The components live exactly as long as the app (past in-flight requests)."""
    await app[COMPONENTS].start()
    yield
    await app[COMPONENTS].stop()
