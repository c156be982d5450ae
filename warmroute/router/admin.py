"""The admin API: change the fleet at run time. Only registered when `admin_token` is set; every call needs
`Authorization: Bearer TOKEN`.

  GET    /admin/instances               every instance: name, url, source, healthy, draining, inflight
  POST   /admin/instances               add {"name", "url", "kv_capacity_tokens"?}; 201 once health-checked
  POST   /admin/instances/{name}/drain  no new requests; removed once its in-flight requests finish (202)
  DELETE /admin/instances/{name}        removed now (open streams still finish, uncounted)
  POST   /admin/reset_prefix_cache      every instance's (or ?instance=NAME's) POST /reset_prefix_cache; the
                                        router forgets what it believed each instance that reset held
  GET    /admin/scale-in                the instance whose cache is worth least (the one to remove when scaling
                                        in), each instance's value and pod-deletion cost (autoscaling.py)
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from warmroute.router.auth import require_token
from warmroute.router.autoscaling import FleetSignals
from warmroute.router.connections import UPSTREAMS
from warmroute.router.discovery import ADMIN, Membership
from warmroute.router.errors import ApiError, bad_request
from warmroute.router.health import HEALTH

MEMBERSHIP = web.AppKey("membership", Membership)
ADMIN_TOKEN = web.AppKey("admin_token", str)
SIGNALS = web.AppKey("signals", FleetSignals)
MAX_ADMIN_BODY = 64 * 1024


def add_admin_routes(app: web.Application, token: str) -> None:
    app[ADMIN_TOKEN] = token
    app.router.add_get("/admin/instances", list_instances)
    app.router.add_post("/admin/instances", add_instance)
    app.router.add_post("/admin/instances/{name}/drain", drain_instance)
    app.router.add_delete("/admin/instances/{name}", delete_instance)
    app.router.add_post("/admin/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/admin/scale-in", scale_in)


def _auth(request: web.Request) -> Membership:
    require_token(request, request.app[ADMIN_TOKEN])
    return request.app[MEMBERSHIP]


def _one(membership: Membership, name: str) -> dict:
    for entry in membership.listing():
        if entry["name"] == name:
            return entry
    raise ApiError(404, f"no instance named {name!r}", "not_found_error")


async def list_instances(request: web.Request) -> web.Response:
    membership = _auth(request)
    return web.json_response({"instances": membership.listing()})


async def scale_in(request: web.Request) -> web.Response:
    """Which instance to remove: the one whose cache is worth least to the fleet (victim null: none to name)."""
    _auth(request)
    return web.json_response(request.app[SIGNALS].scale_in())


async def add_instance(request: web.Request) -> web.Response:
    from warmroute.router.settings import Backend  # the same validation as configured backends

    membership = _auth(request)
    if request.content_length is not None and request.content_length > MAX_ADMIN_BODY:
        raise ApiError(413, "admin request body too large")
    try:
        data = json.loads(await request.read())
    except ValueError:
        raise bad_request("body must be a JSON object with name and url") from None
    if not isinstance(data, dict):
        raise bad_request("body must be a JSON object with name and url")
    try:
        backend = Backend(**data)
    except (ValidationError, TypeError) as exc:
        detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        raise bad_request(f"invalid instance: {detail.removeprefix('Value error, ')}") from None
    existed = backend.name in membership.members
    if not membership.add(backend, ADMIN):
        raise ApiError(409, f"instance {backend.name!r} comes from the configuration; change it there",
                       "conflict_error")
    await request.app[HEALTH].check_now(backend.name)  # answer with its real state
    return web.json_response(_one(membership, backend.name), status=200 if existed else 201)


async def drain_instance(request: web.Request) -> web.Response:
    membership = _auth(request)
    name = request.match_info["name"]
    entry = _one(membership, name)
    membership.drain(name)
    gone = name not in membership.fleet.instances
    return web.json_response({**entry, "draining": True, "removed": gone}, status=200 if gone else 202)


async def delete_instance(request: web.Request) -> web.Response:
    membership = _auth(request)
    name = request.match_info["name"]
    entry = _one(membership, name)
    membership.remove(name)
    return web.json_response({**entry, "removed": True})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Fan an engine control operation out to the fleet (clients can never reach it: app.py answers 404), and
    keep the index true: an instance that reset holds nothing the router believed it held."""
    membership = _auth(request)
    only = request.query.get("instance")
    names = [only] if only is not None else list(membership.members)
    if only is not None:
        _one(membership, only)
    upstreams, urls = request.app[UPSTREAMS], membership.urls
    if not upstreams.started:
        raise ApiError(503, "the router is still starting", "service_unavailable")
    timeout = aiohttp.ClientTimeout(total=request.app[HEALTH].settings.timeout * 5)
    statuses = await asyncio.gather(*(_post(upstreams.session, urls.get(n), "/reset_prefix_cache", timeout)
                                      for n in names))
    results = {}
    for name, status in zip(names, statuses):
        reset = status is not None and 200 <= status < 300
        if reset:
            membership.fleet.index.clear_instance(name)
        results[name] = {"status": status, "reset": reset}
    ok = all(r["reset"] for r in results.values())
    return web.json_response({"reset": ok, "instances": results}, status=200 if ok else 502)


async def _post(session: aiohttp.ClientSession, url: str | None, path: str,
                timeout: aiohttp.ClientTimeout) -> int | None:
    """POST to one instance; its status, or None if it could not be reached."""
    if url is None:
        return None
    try:
        async with session.post(url + path, timeout=timeout) as r:
            await r.read()
            return r.status
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
