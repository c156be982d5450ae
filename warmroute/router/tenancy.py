"""Who sent a request and how urgent it is: its tenant (fair shares) and priority (admission order), from
its headers and the settings. The queue that uses them is core/admission.py."""

from __future__ import annotations

import hashlib

from multidict import CIMultiDictProxy

from warmroute.core.routing_key import RoutingKey
from warmroute.router.errors import bad_request
from warmroute.router.routing import SESSION_HEADER
from warmroute.router.settings import RouterSettings

PRIORITY_RANGE = (-1000, 1000)
_MAX_TENANT = 128  # characters of a tenant name taken from a header or body


def tenant_of(headers: CIMultiDictProxy[str], key: RoutingKey | None, settings: RouterSettings) -> str:
    """The first of settings.tenant_from found: the tenant header, the API key (hashed: it is a secret and
    becomes a metric label), the body's `user` field; "" when none is."""
    for source in settings.tenant_from:
        if source == "header":
            value = headers.get(settings.tenant_header, "").strip()
            if value:
                return value[:_MAX_TENANT]
        elif source == "api_key":
            auth = headers.get("Authorization", "")
            if auth[:7].lower() == "bearer " and auth[7:].strip():
                return "key-" + hashlib.sha256(auth[7:].strip().encode()).hexdigest()[:12]
        elif source == "user" and key is not None and key.session and SESSION_HEADER not in headers:
            return key.session[:_MAX_TENANT]  # without the session header, the key's session is the user field
    return ""


def priority_of(headers: CIMultiDictProxy[str], tenant: str, key: RoutingKey | None,
                settings: RouterSettings) -> int:
    """The priority header, else the tenant's, else the model's, else 0 (higher goes first)."""
    raw = headers.get(settings.priority_header)
    if raw is not None:
        try:
            value = int(raw.strip())
        except ValueError:
            value = None
        if value is None or not PRIORITY_RANGE[0] <= value <= PRIORITY_RANGE[1]:
            raise bad_request(f"header {settings.priority_header} must be an integer from {PRIORITY_RANGE[0]} to "
                              f"{PRIORITY_RANGE[1]}")
        return value
    if tenant in settings.tenant_priorities:
        return settings.tenant_priorities[tenant]
    model = key.model if key is not None else None
    return settings.model_priorities.get(model, 0) if model is not None else 0
