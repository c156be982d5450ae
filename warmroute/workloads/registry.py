"""Workloads by name, built with size parameters given as values or as command-line strings."""

from __future__ import annotations

import dataclasses

from warmroute.errors import UsageError
from warmroute.workloads.base import Workload
from warmroute.workloads.chat import MultiTurn
from warmroute.workloads.hot import HotPrompt
from warmroute.workloads.mixed import Mixed
from warmroute.workloads.rag import Rag
from warmroute.workloads.shared import SharedPrompts
from warmroute.workloads.trace import TraceReplay

WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in (Mixed, SharedPrompts, MultiTurn, Rag, HotPrompt, TraceReplay)
}


def make_workload(name: str, seed: int = 0, **params: object) -> Workload:
    """Build workload `name`; `params` set its size fields (strings are converted to the field's type)."""
    cls = WORKLOADS.get(name)
    if cls is None:
        raise UsageError(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise UsageError(f"workload {name!r} has no parameter {unknown[0]!r} (it has: {', '.join(fields)})")
    values = {k: _convert(k, v, fields[k].default) for k, v in params.items()}
    try:
        return cls(seed=seed, **values)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"workload {name!r}: {exc}") from None


def parse_params(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` strings (from --param) to a dict."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--param expects KEY=VALUE, got {pair!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _convert(key: str, value: object, default: object) -> object:
    if not isinstance(value, str) or isinstance(default, str):
        return value
    kind = int if default is None else type(default)  # the only None default is an optional count
    try:
        return kind(value)
    except ValueError:
        raise UsageError(f"workload parameter {key}={value!r}: expected {kind.__name__}") from None
