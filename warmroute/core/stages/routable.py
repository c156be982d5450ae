"""The pipeline's first set of candidates: the routable instances that may serve the request's model."""

from __future__ import annotations

from warmroute.core.decision import ModelNotServed, NoInstanceAvailable
from warmroute.core.fleet import Fleet, Instance


def routable(fleet: Fleet, model: str | None = None) -> list[Instance]:
    """Healthy, not draining, serving `model`; raises when there are none (ModelNotServed when only the model
    is missing: the shell answers each differently)."""
    up = fleet.routable(model)
    if not up:
        if model is not None and fleet.routable():
            raise ModelNotServed(model)
        raise NoInstanceAvailable("no healthy instance")
    return up
