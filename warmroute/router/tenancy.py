"""Who sent a request and how urgent it is: its tenant (fair shares) and priority class (admission order), from
what the router can believe about it. The queue that uses them is core/admission/, which sees only the results.

The model (docs/deployment.md, "Who may claim what"): a request's tenant is its API key's (a tenant named in
`api_keys`, else a salted hash of the key), or `anonymous` without one; headers and the body's `user` field name a
tenant or a priority only with `trust_client_headers`, and a priority is never above its tenant's maximum. Every
priority maps to one of a few declared classes, so what reaches the queue and the metrics is a bounded set.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import os

from multidict import CIMultiDictProxy

from warmroute.core.routing_key import RoutingKey
from warmroute.router.errors import bad_request
from warmroute.router.routing import SESSION_HEADER
from warmroute.router.settings import RouterSettings

PRIORITY_RANGE = (-1000, 1000)
ANONYMOUS = "anonymous"  # the tenant of every request without an API key (and of unknown keys with api_keys)
_MAX_TENANT = 128  # characters of a tenant name taken from a header or body
_SALT = os.urandom(16)  # made at import, in the parent process: forked workers name keys alike


class PriorityClasses:
    """The declared priorities (name -> value); any integer maps to the nearest (ties: the lower)."""

    def __init__(self, settings: RouterSettings) -> None:
        declared = dict(settings.priority_classes)
        if not declared:  # the integers the configuration uses, and 0
            used = {0, *settings.tenant_priorities.values(), *settings.tenant_max_priorities.values(),
                    *settings.model_priorities.values()}
            declared = {str(v): v for v in sorted(used)}
        self.by_name = declared
        self.values = sorted(declared.values())
        self.labels = {v: n for n, v in declared.items()}  # value -> its metric label

    def nearest(self, value: int) -> int:
        at = bisect.bisect_left(self.values, value)
        if at == 0:
            return self.values[0]
        if at == len(self.values):
            return self.values[-1]
        below, above = self.values[at - 1], self.values[at]
        return above if above - value < value - below else below

    def at_most(self, value: int) -> int:
        """The highest class not above `value` (the lowest class if every one is)."""
        at = bisect.bisect_right(self.values, value)
        return self.values[max(0, at - 1)]


class Tenancy:
    """A request's tenant and priority class, by the settings (built once per router)."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.trusted = settings.trust_client_headers
        self.classes = PriorityClasses(settings)
        salt = settings.api_key_salt
        self._salt = salt.get_secret_value().encode() if salt is not None else _SALT
        self._keys = dict(settings.api_keys)  # sha256 hex of a key -> its tenant

    def who(self, headers: CIMultiDictProxy[str], key: RoutingKey | None) -> tuple[str, int]:
        """A request's tenant and priority, as serve and the gateway's picker both name them."""
        tenant = self.tenant_of(headers, key)
        return tenant, self.priority_of(headers, tenant, key)

    def tenant_of(self, headers: CIMultiDictProxy[str], key: RoutingKey | None) -> str:
        """The first of tenant_from found (header and user only from a trusted hop); `anonymous` when none is."""
        s = self.settings
        for source in s.tenant_from:
            if source == "header" and self.trusted:
                value = headers.get(s.tenant_header, "").strip()
                if value:
                    return value[:_MAX_TENANT]
            elif source == "api_key":
                auth = headers.get("Authorization", "")
                if auth[:7].lower() == "bearer " and auth[7:].strip():
                    return self.key_tenant(auth[7:].strip())
            elif (source == "user" and self.trusted and key is not None and key.session
                  and SESSION_HEADER not in headers):  # without the session header, the key's session is the user field
                return key.session[:_MAX_TENANT]
        return ANONYMOUS

    def key_tenant(self, api_key: str) -> str:
        """The tenant of an API key: api_keys' (`anonymous` for a key not listed there), else a salted hash of
        it (the key is a secret, and the name becomes a metric label)."""
        raw = api_key.encode("utf-8", "surrogateescape")
        if self._keys:
            return self._keys.get(hashlib.sha256(raw).hexdigest(), ANONYMOUS)
        return "key-" + hmac.new(self._salt, raw, hashlib.sha256).hexdigest()[:12]

    def priority_of(self, headers: CIMultiDictProxy[str], tenant: str, key: RoutingKey | None) -> int:
        """The request's priority class: the priority header's (from a trusted hop), else the tenant's, else the
        model's, else 0, mapped to the nearest class and never above the tenant's maximum (higher goes first)."""
        s, classes = self.settings, self.classes
        default = s.tenant_priorities.get(tenant)
        if default is None:
            model = key.model if key is not None else None
            default = s.model_priorities.get(model, 0) if model is not None else 0
        default = classes.nearest(default)
        ceiling = s.tenant_max_priorities.get(tenant)
        ceiling = default if ceiling is None else classes.at_most(ceiling)
        raw = headers.get(s.priority_header) if self.trusted else None
        value = default if raw is None else classes.nearest(self._claimed(raw))
        return min(value, ceiling)

    def _claimed(self, raw: str) -> int:
        s = self.settings
        raw = raw.strip()
        if raw in self.classes.by_name:
            return self.classes.by_name[raw]
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or not PRIORITY_RANGE[0] <= value <= PRIORITY_RANGE[1]:
            names = ", ".join(self.classes.by_name)
            raise bad_request(f"header {s.priority_header} must be a priority class ({names[:200]}) or an integer "
                              f"from {PRIORITY_RANGE[0]} to {PRIORITY_RANGE[1]}")
        return value

    def label(self, priority: int) -> str:
        """A priority class's metric label (its name); `other` for a value that is no class."""
        return self.classes.labels.get(priority, "other")


def declared_tenants(settings: RouterSettings) -> set[str]:
    """The tenants the settings name (their metric labels are never capped or removed), and `anonymous`."""
    return {ANONYMOUS, *settings.api_keys.values(), *settings.admission.tenant_weights, *settings.tenant_priorities,
            *settings.tenant_max_priorities}
