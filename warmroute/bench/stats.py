"""Per-request records and the statistics of a run: latency percentiles, throughput, hit rates, load spread."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    tag: str
    start_s: float  # from the start of the run
    ttft_s: float | None = None  # first data chunk carrying content
    e2e_s: float | None = None  # end of the stream
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the server's usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    instance: str | None = None  # x-warmroute-instance response header
    error: str | None = None  # kind of failure ("http_503", "timeout", "connect", ...), None if it succeeded
    tenant: str = ""  # the workload request's tenant (sent as x-tenant)
    predicted_hit: float | None = None  # x-warmroute-predicted-hit: share of the prompt the router predicted cached
    queued_s: float | None = None  # seconds it waited in the router (x-warmroute-reason's queued=), if it did

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None

    @property
    def prediction_error_tokens(self) -> float | None:
        """Router-predicted minus engine-reported cached tokens, in the engine's tokens (None if either is unknown)."""
        if self.predicted_hit is None or self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.predicted_hit * self.prompt_tokens - self.cached_tokens


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def to_ms(seconds: float | None, digits: int = 3) -> float | None:
    """Seconds as milliseconds rounded to `digits` decimals (for JSON), None stays None."""
    return None if seconds is None else round(1000 * seconds, digits)


def hit_rate(hits: float, queries: float) -> float | None:
    return hits / queries if queries > 0 else None


def load_spread(counts: dict[str, int], instances: int = 0) -> float | None:
    """Busiest instance's requests over the mean (1.0 = perfectly even); instances that got none count."""
    n = max(len(counts), instances)
    total = sum(counts.values())
    return max(counts.values()) / (total / n) if total else None


@dataclass
class BenchResult:
    label: str
    target: str
    workload: str
    mode: str  # how load was offered, e.g. "closed loop, 16 concurrent"
    duration_s: float  # the measured window
    records: list[RequestRecord] = field(repr=False)  # requests started inside the window
    fleet_hit_rate: float | None = None  # from the engines' prefix-cache counters over the window
    instances: int = 0  # how many instances serve the target, when known
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    def ttft_ms(self) -> list[float]:
        return [r.ttft_s * 1000 for r in self.ok if r.ttft_s is not None]

    def e2e_ms(self) -> list[float]:
        return [r.e2e_s * 1000 for r in self.ok if r.e2e_s is not None]

    @property
    def errors(self) -> dict[str, int]:
        return dict(sorted(Counter(r.error for r in self.records if r.error).items()))

    @property
    def instance_requests(self) -> dict[str, int]:
        return dict(sorted(Counter(r.instance for r in self.ok if r.instance).items()))

    @property
    def client_hit_rate(self) -> float | None:
        return _client_hit_rate(self.ok)

    def summary(self) -> dict[str, Any]:
        """Everything reported, with stable keys (the --json output)."""
        ok, ttft, e2e = self.ok, self.ttft_ms(), self.e2e_ms()
        window = self.duration_s or math.nan
        return {
            "label": self.label,
            "target": self.target,
            "workload": self.workload,
            "mode": self.mode,
            "duration_s": round(self.duration_s, 3),
            "requests": len(ok),
            "errors": self.errors,
            "ttft_ms": {"p50": _r(percentile(ttft, 50)), "p90": _r(percentile(ttft, 90)),
                        "p99": _r(percentile(ttft, 99))},
            "e2e_ms": {"p50": _r(percentile(e2e, 50)), "p99": _r(percentile(e2e, 99))},
            "throughput": {"requests_per_s": _r(len(ok) / window, 3),
                           "output_tokens_per_s": _r(sum(r.output_tokens for r in ok) / window, 1)},
            "hit_rate": {"fleet": _r(self.fleet_hit_rate, 4), "client": _r(self.client_hit_rate, 4)},
            "prediction_error_tokens": self.prediction_error(),
            "instances": {"requests": self.instance_requests,
                          "load_spread": _r(load_spread(self.instance_requests, self.instances), 3)},
            "by_class": self.by_class(),
            "warnings": list(self.warnings),
        }

    def prediction_error(self) -> dict[str, Any]:
        """How far the router's predicted cached tokens were from what the engines reported, per request."""
        errors = [e for r in self.ok if (e := r.prediction_error_tokens) is not None]
        size = [abs(e) for e in errors]
        return {"requests": len(errors), "median_abs": _r(percentile(size, 50)), "p90_abs": _r(percentile(size, 90)),
                "mean": _r(sum(errors) / len(errors) if errors else None)}

    def by_class(self) -> dict[str, dict[str, Any]]:
        out = {}
        for tag in sorted({r.tag for r in self.records}):
            rs = [r for r in self.ok if r.tag == tag]
            ttft = [r.ttft_s * 1000 for r in rs if r.ttft_s is not None]
            out[tag] = {"requests": len(rs), "ttft_p50_ms": _r(percentile(ttft, 50)),
                        "ttft_p99_ms": _r(percentile(ttft, 99)), "client_hit_rate": _r(_client_hit_rate(rs), 4)}
        return out


def _client_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    reported = [r for r in records if r.prompt_tokens and r.cached_tokens is not None]
    return hit_rate(sum(r.cached_tokens or 0 for r in reported), sum(r.prompt_tokens or 0 for r in reported))


def _r(x: float | None, digits: int = 1) -> float | None:
    return None if x is None or math.isnan(x) else round(x, digits)
