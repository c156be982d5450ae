"""Errors the router answers itself, always as OpenAI-style JSON: {"error": {"message", "type"}}."""

from __future__ import annotations

import json

from aiohttp import web

from warmroute.router.metrics import NO_INSTANCE


class ApiError(Exception):
    """Raised anywhere in a handler; the error middleware turns it into a JSON response."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", *,
                 instance: str = NO_INSTANCE, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.instance = instance  # metric label: which instance failed, if one was chosen
        self.headers = headers or {}


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit} bytes (max_body_bytes)")


def no_instance(retry_after_s: float, model: str | None = None) -> ApiError:
    what = "no healthy upstream instance is available" if model is None else \
        f"no healthy upstream instance serves model {model!r}"
    return ApiError(503, f"{what}; retry shortly", "service_unavailable",
                    headers={"Retry-After": str(max(1, round(retry_after_s)))})


def error_body(status: int, message: str, kind: str) -> str:
    """The JSON body of an error the router answers itself (also `warmroute epp`'s immediate responses)."""
    return json.dumps({"error": {"message": message, "type": kind, "code": status}})


def json_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=error_body(status, message, kind), content_type="application/json",
                        headers=headers)
