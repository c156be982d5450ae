"""Instances as the gateway names them: `ip:port`, the value of x-gateway-destination-endpoint."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import lru_cache
from urllib.parse import urlsplit

from warmroute.router.discovery import is_address

_DEFAULT_PORTS = {"http": 80, "https": 443}


@lru_cache(maxsize=4096)  # one per instance URL; asked on every request
def endpoint_of(url: str) -> str:
    """http://10.0.0.5:8000 -> 10.0.0.5:8000; http://[fd00::5]:8000 -> [fd00::5]:8000."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_of(url: str) -> str:
    return urlsplit(url).hostname or ""


def names_at(urls: Mapping[str, str], endpoints: Iterable[str]) -> set[str]:
    """The instances whose address is one of `endpoints`."""
    wanted = {e.strip() for e in endpoints}
    return {name for name, url in urls.items() if endpoint_of(url) in wanted}


def unaddressed(urls: Mapping[str, str]) -> list[str]:
    """Instances whose URL names a host instead of an address: a gateway's ORIGINAL_DST cluster cannot reach them."""
    return [name for name, url in urls.items() if not is_address(host_of(url))]
