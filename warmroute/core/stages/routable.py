"""The pipeline's first set of candidates: the routable instances that may serve the request's model."""

from __future__ import annotations

from warmroute.core.decision import ModelNotServed, NoInstanceAvailable
from warmroute.core.fleet import Fleet, Instance


def routable(fleet: Fleet, model: str | None = None, but: str | None = None) -> list[Instance]:
    """Healthy, not draining, serving `model`, and not `but` (left out as if it were down); raises when there are
    none (ModelNotServed when only the model is missing: the shell answers each differently)."""
    up = fleet.routable(model)
    if but is not None:
        up = [i for i in up if i.name != but]
    if not up:
        if model is not None and any(i.name != but for i in fleet.routable()):
            raise ModelNotServed(model)
        raise NoInstanceAvailable("no healthy instance")
    return up
