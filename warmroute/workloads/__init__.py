"""Workload generators shared by the load generator and the simulator: pure, seeded, reproducible.

A workload is a stream of `Session`s; a session is one or more `WorkloadRequest`s to issue in order (the
turns of a chat). Build one by name with `make_workload(name, seed, **sizes)`.
"""

from warmroute.workloads.base import DEFAULT_MODEL, Workload
from warmroute.workloads.registry import WORKLOADS, make_workload, parse_params
from warmroute.workloads.request import Session, WorkloadRequest

__all__ = ["DEFAULT_MODEL", "WORKLOADS", "Session", "Workload", "WorkloadRequest", "make_workload", "parse_params"]
