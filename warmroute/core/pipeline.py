"""The shape of every routing decision: facts about the request, then filters, scorers and pickers.

    routable instances ─▶ facts ─▶ filters ─▶ scorers ─▶ pickers ─▶ one instance, and why

* Facts (`Facts.observe`) work out what the later stages read about this request: its blocks, who holds them,
  how much a cache miss weighs. They choose nothing.
* Filters (`Filter.filter`) remove instances that must not take the request (over the load guard, a hot
  prefix's holders past their share). A filter that would remove every candidate decides instead
  (`Filter.when_empty`).
* Scorers (`Scorer.score`) give each candidate a cost in seconds (lower is better); with several, the
  pipeline adds them, each times its weight.
* Pickers narrow the candidates (`Picker.narrow`: within a tie slack of the cheapest, the least loaded of
  those); the last one picks one (`Picker.pick`).

The reason of the decision comes from the stages: each may `explain` the chosen instance (facts, then
filters, scorers, pickers, in that order); the first that does gives the reason.

Stages are registered by name in `warmroute.core.stages`; strategies (`warmroute.core.strategies`) are lists
of stage names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from warmroute.core.fleet import Fleet, Instance
from warmroute.core.routing_key import RoutingKey


class Request:
    """One decision's state: the key, the fleet, the routable instances, and the facts stages add (class-level
    defaults, so that a decision sets only what its stages use)."""

    blocks: Sequence[int] = ()
    depths: dict[str, int] = {}  # cached prefix length in blocks, per instance holding one (never mutated)
    deepest = 0
    alpha = 1.0  # what one uncached prompt token costs, in queued tokens
    holder = ""  # who holds the deepest match (prefix_match.PRIVATE, SHARED or SWAMPED)
    miss: dict[str, float] = {}  # alpha x uncached tokens, per instance holding part of the prompt (never mutated)
    miss_all = 0.0  # the same anywhere else
    hot = False  # its prefix carries at least 1/N of the recent requests (hot_share)
    share_cap = math.nan  # hot_share's cap on recent requests, once computed (HotShare.cap)
    ramp_caps: dict[str, float] = {}  # slow_start: recent requests each ramping instance may have had (never mutated)
    picked_reason = ""  # what a picker that knows its own reason (affinity) said
    # Precise mode (None: off): the share of the prompt each engine whose KV events are fresh reports holding.
    precise: dict[str, float] | None = None

    def __init__(self, key: RoutingKey, fleet: Fleet, up: list[Instance]) -> None:
        self.key, self.fleet, self.up = key, fleet, up
        self.prompt = key.tokens
        self.block_tokens = fleet.block_tokens


class Stage:
    """One step of the decision. `name` is its key in the stage registry."""

    name = ""

    def explain(self, req: Request, chosen: Instance) -> str | None:
        """The decision's reason, if this stage is why `chosen` was chosen (None: ask the next stage)."""
        return None


class Facts(Stage):
    def observe(self, req: Request) -> None:
        raise NotImplementedError


class Filter(Stage):
    def prepare(self, req: Request) -> None:
        """Per-request values computed before any filtering."""

    def filter(self, req: Request, candidates: list[Instance]) -> list[Instance]:
        raise NotImplementedError

    def when_empty(self, req: Request) -> tuple[Instance, str]:
        """The choice, and its reason, when this filter left no candidate."""
        raise NotImplementedError


class Scorer(Stage):
    weight = 1.0

    def score(self, req: Request, candidates: list[Instance]) -> list[float]:
        """A cost per candidate, in seconds; lower is better."""
        raise NotImplementedError


class Picker(Stage):
    def narrow(self, req: Request, candidates: list[Instance], costs: list[float] | None
               ) -> tuple[list[Instance], list[float] | None]:
        """The candidates (and their costs) still in the running; by default all of them."""
        return candidates, costs

    def pick(self, req: Request, candidates: list[Instance]) -> Instance:
        """One of several candidates (only the last picker is asked)."""
        raise NotImplementedError


class Pipeline:
    def __init__(self, facts: Sequence[Facts] = (), filters: Sequence[Filter] = (), scorers: Sequence[Scorer] = (),
                 pickers: Sequence[Picker] = ()) -> None:
        if not pickers:
            raise ValueError("a pipeline needs a picker")
        self.facts, self.filters, self.scorers, self.pickers = list(facts), list(filters), list(scorers), list(pickers)
        self._stages = [*self.facts, *self.filters, *self.scorers, *self.pickers]
        # Bound methods of the stages that do something there, looked up once: this runs on every decision.
        self._observers = [f.observe for f in self.facts]
        self._preparers = [f.prepare for f in self.filters if type(f).prepare is not Filter.prepare]
        self._explainers = [s.explain for s in self._stages if type(s).explain is not Stage.explain]
        self._pick = self.pickers[-1].pick
        self._narrowers = self.pickers[:-1]

    def stage(self, name: str) -> Any:
        """The stage registered under `name` in this pipeline (KeyError if none)."""
        for s in self._stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def run(self, req: Request) -> tuple[Instance, str]:
        """The chosen instance and the reason for it."""
        for observe in self._observers:
            observe(req)
        for prepare in self._preparers:
            prepare(req)
        found = self.narrow(req)
        if found is None:  # a filter left nobody: it decides
            return self._emptied_by(req).when_empty(req)
        chosen = self._pick(req, found)
        for explain in self._explainers:
            why = explain(req, chosen)
            if why is not None:
                return chosen, why
        raise RuntimeError("no stage explained the decision")  # the last picker always should

    def narrow(self, req: Request) -> list[Instance] | None:
        """Filters, scorers and all pickers but the last: the candidates left for the last picker (None when a filter
        left none)."""
        candidates = req.up
        if not self.scorers and not self.filters and not self._narrowers:  # a one-picker pipeline: all of them
            return candidates
        for f in self.filters:
            candidates = f.filter(req, candidates)
            if not candidates:
                return None
        costs = self.costs(req, candidates) if self.scorers else None
        for p in self._narrowers:
            if len(candidates) == 1:
                break
            candidates, costs = p.narrow(req, candidates, costs)
        return candidates

    def costs(self, req: Request, candidates: list[Instance]) -> list[float]:
        if len(self.scorers) == 1 and self.scorers[0].weight == 1.0:
            return self.scorers[0].score(req, candidates)
        total = [0.0] * len(candidates)
        for s in self.scorers:
            total = [t + s.weight * c for t, c in zip(total, s.score(req, candidates))]
        return total

    def _emptied_by(self, req: Request) -> Filter:
        """The filter that left no candidate (re-run: `narrow` says only that one did)."""
        candidates = req.up
        for f in self.filters:
            candidates = f.filter(req, candidates)
            if not candidates:
                return f
        raise RuntimeError("the fast path found no candidate where the filters do")

    def trace(self, req: Request) -> list[tuple[str, list[str]]]:
        """Stage by stage, the names of the candidates each filter and narrowing picker kept (for explaining a
        decision; the facts must have been observed and the filters prepared, as `run` does)."""
        out = [("routable", [i.name for i in req.up])]
        candidates = req.up
        for f in self.filters:
            candidates = f.filter(req, candidates)
            out.append((f.name, [i.name for i in candidates]))
            if not candidates:
                return out
        costs = self.costs(req, candidates) if self.scorers else None
        for p in self._narrowers:
            candidates, costs = p.narrow(req, candidates, costs)
            out.append((p.name, [i.name for i in candidates]))
        return out
