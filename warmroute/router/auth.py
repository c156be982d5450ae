"""Bearer-token checks for the router's own control endpoints (the admin API).

The token is compared with `hmac.compare_digest` (constant time), never logged, never echoed. Without a
configured token the admin routes are not registered at all, so there is nothing to guess at.
"""

from __future__ import annotations

import hmac

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
