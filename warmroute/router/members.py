"""What the parts of the router that follow the fleet's membership see: one event per change of an instance.

`Membership` (discovery.py) is the only writer; a follower subscribes with `Membership.subscribe(listener)`
and gets, in the order of subscription:
  added(member)    an instance joined (and, at subscription, each instance already there);
  changed(member)  an instance was given again (its URL, capacity, models or event endpoints may differ);
  removed(name)    an instance left (drained, or deleted through the admin API).
Followers keep what they need of it themselves (`Addresses`: each its own name -> URL map); none shares a map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from warmroute.router.settings import Backend


@dataclass
class Member:
    backend: Backend  # as last given by its source
    source: str  # who added it: config, admin, kubernetes, inference-pool
    capacity_configured: bool  # the user gave its KV capacity (else the engine's own figure is taken)

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def url(self) -> str:
        return self.backend.url


class MembershipListener(Protocol):
    def added(self, member: Member) -> None: ...

    def changed(self, member: Member) -> None: ...

    def removed(self, name: str) -> None: ...


class Addresses:
    """A follower's own map of the current instances' base URLs; subclasses extend the callbacks (super() first)."""

    def __init__(self) -> None:
        self.urls: dict[str, str] = {}

    def added(self, member: Member) -> None:
        self.urls[member.name] = member.url

    def changed(self, member: Member) -> None:
        self.urls[member.name] = member.url

    def removed(self, name: str) -> None:
        self.urls.pop(name, None)
