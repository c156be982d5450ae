"""Bearer-token checks for the router's own control endpoints (the admin API).

The token is compared with `hmac.compare_digest` (constant time), never logged, never echoed. Without a
configured token the admin routes are not registered at all, so there is nothing to guess at.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from warmroute.router.errors import ApiError


def bearer_token(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def token_matches(given: str | None, expected: str) -> bool:
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape"))


def require_token(request: web.Request, expected: str) -> None:
    """401 (with WWW-Authenticate) unless the request carries the expected bearer token."""
    if not token_matches(bearer_token(request), expected):
        raise ApiError(401, "missing or invalid bearer token", "authentication_error",
                       headers={"WWW-Authenticate": 'Bearer realm="warmroute-admin"'})


def _basic_password(request: web.Request) -> str | None:
    """The password of an `Authorization: Basic ...` header (any user name), or None."""
    scheme, _, encoded = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(encoded.strip(), validate=True).decode("utf-8", "surrogateescape").partition(":")[2]
    except (binascii.Error, ValueError):
        return None


def observers_only(handler: Callable[[web.Request], Awaitable[web.StreamResponse]], expected: str | None,
                   ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """`handler` behind observability_token (unchanged without one): a bearer token for scrapers, or HTTP Basic
    with the token as password, which a browser asks for and then sends with the dashboard's own requests."""
    if expected is None:
        return handler

    async def guarded(request: web.Request) -> web.StreamResponse:
        if not (token_matches(bearer_token(request), expected) or token_matches(_basic_password(request), expected)):
            raise ApiError(401, "missing or invalid observability token", "authentication_error",
                           headers={"WWW-Authenticate": 'Basic realm="warmroute", charset="UTF-8"'})
        return await handler(request)
    return guarded
