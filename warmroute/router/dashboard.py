"""The live status page: GET /dashboard (plain HTML + JS, no build step) polls GET /dashboard/state every second.

What it shows: instances (health, draining, in flight, requests), the predicted and engine-reported hit
rates, the requests waiting in the router's admission queue (by priority and tenant) with the admitted and
refused counts, the hottest prefixes by share of recent traffic, the latest routing decisions, and charts of the
last ten minutes (`Timeline`: a point every SAMPLE_EVERY_S, in a ring of fixed length). Never prompt text
and never addresses: a prefix is shown as a keyed hash of its first KiB (a fresh random key per `warmroute
serve`, so the ids cannot be matched against a dictionary of known prompts), a decision as instance name and
reason.

With `workers` > 1 each worker sends the others a snapshot of its own figures every second (`snapshot`, over
the local sockets of shared_index.WorkerLinks) and the one that answers /dashboard/state adds them to its own:
the page shows the whole router, whichever worker the poll reaches. The charts too: each worker's
timeline sums its own counters' and the others' latest snapshot's deltas (each worker's separately, so one that
leaves or restarts is never a drop); the workers sample at their own moments, so two polls may show points a
few seconds apart. The key is made once, before the workers
are forked, so all of them label a prefix alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import deque
from typing import Any

from aiohttp import web

from warmroute.core.admission import Admission
from warmroute.core.fleet import Fleet
from warmroute.core.routing_key import RoutingKey
from warmroute.core.strategies import Decision
from warmroute.router.components import Periodic
from warmroute.router.metrics import Metrics

HOT_SLOTS = 64  # prefixes counted (Space-Saving: the heavy hitters are kept, the tail shares the rest)
HOT_SHOWN = 10
RECENT = 30  # decisions shown
HALVE_EVERY = 20_000  # requests: counts are halved so the shares follow recent traffic
PREFIX_BYTES = 1024  # a prefix is identified by its first KiB
SNAPSHOT_EVERY_S = 1.0  # workers > 1: how often a worker sends its figures to the others
SNAPSHOT_FRESH_S = 5.0  # a sibling's snapshot older than this is left out (the worker is gone or stuck)
SAMPLE_EVERY_S = 5.0  # the charts: one point per interval...
HISTORY_S = 600.0  # ...over the last ten minutes
INSTANCE_LINES = 8  # in-flight lines drawn: the busiest instances of the window (the rest summed as "others")
_LABEL_KEY = os.urandom(16)  # made at import, in the parent process: forked workers share it


class Activity:
    """Bounded, cheap per-request bookkeeping for the page: O(1) per request (amortised: see `_count`)."""

    def __init__(self, block_bytes: int) -> None:
        self._depth = max(1, PREFIX_BYTES // block_bytes)
        self._block_bytes = block_bytes
        self._counts: dict[int, float] = {}
        self._total = 0.0
        self._floor = 0.0  # the highest count dropped so far (halved with the others)
        self._seen = 0
        self.recent: deque[tuple[float, str, str, float]] = deque(maxlen=RECENT)
        self.predicted_tokens = 0
        self.prompt_tokens = 0

    def note(self, key: RoutingKey | None, decision: Decision) -> None:
        self.recent.append((time.time(), decision.instance, decision.reason, decision.matched_ratio))
        if key is None:
            return
        self.predicted_tokens += decision.matched_tokens
        self.prompt_tokens += decision.prompt_tokens
        blocks = key.blocks(self._block_bytes)
        if not blocks:
            return
        h = blocks[min(len(blocks), self._depth) - 1]
        self._count(h)

    def _count(self, h: int) -> None:
        counts = self._counts
        if h in counts:
            counts[h] += 1
        else:  # Space-Saving, evicting in batches: a newcomer may have been dropped before, so it starts above
            if len(counts) >= HOT_SLOTS:  # the highest count dropped (never underestimated); one sort per
                counts = self._drop_lower_half()  # HOT_SLOTS/2 newcomers instead of a scan for each
            counts[h] = self._floor + 1
        self._total += 1
        self._seen += 1
        if self._seen % HALVE_EVERY == 0:
            self._total /= 2
            self._floor /= 2
            for k in counts:
                counts[k] /= 2

    def _drop_lower_half(self) -> dict[int, float]:
        ranked = sorted(self._counts.items(), key=lambda kv: kv[1], reverse=True)
        keep = HOT_SLOTS // 2
        self._floor = max(self._floor, ranked[keep][1])
        self._counts = dict(ranked[:keep])
        return self._counts

    def hot(self, others: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """The hottest prefixes with their shares, over this worker's counts and the other workers' snapshots."""
        counts, total = dict(self._counts), self._total
        for snap in others:
            for h, c in snap["hot"]:
                counts[h] = counts.get(h, 0.0) + c
            total += snap["total"]
        labelled = sorted(((-c, _label(h)) for h, c in counts.items()))[:HOT_SHOWN]  # equal counts: by id
        return [{"prefix": label, "share": round(-c / total, 4) if total else 0.0} for c, label in labelled]


def _label(h: int) -> str:
    return hashlib.blake2b(h.to_bytes(8, "little"), key=_LABEL_KEY, digest_size=6).hexdigest()


class Siblings:
    """The latest snapshot of each other worker (workers > 1), as they arrive over the local sockets."""

    def __init__(self) -> None:
        self._latest: dict[int, tuple[float, dict[str, Any]]] = {}  # pid -> (received at, snapshot)

    def receive(self, payload: bytes) -> None:
        try:
            snap = json.loads(payload)
            pid = int(snap["pid"])
            if not _SNAPSHOT_KEYS <= snap.keys():
                raise KeyError("incomplete")
        except (ValueError, KeyError, TypeError, AttributeError):
            return  # not from a sibling of this version: nothing to show
        self._latest[pid] = (time.monotonic(), snap)

    def fresh(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [snap for at, snap in self._latest.values() if now - at <= SNAPSHOT_FRESH_S]


def _metric_totals(metrics: Metrics) -> dict[str, Any]:
    """One pass over this worker's registry: the counters the page reads, each summed over every backend."""
    sums = {"warmroute_engine_prompt_tokens": 0.0, "warmroute_engine_cached_tokens": 0.0,
            "warmroute_predicted_cached_tokens": 0.0}
    answered = refused = 0.0
    ttft: dict[float, float] = {}  # bucket upper bound -> cumulative count
    for family in metrics.registry.collect():
        if family.name in sums:
            sums[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name == "warmroute_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    answered += sample.value
                    refused += sample.value if sample.labels["status"] == "429" else 0.0
        elif family.name == "warmroute_time_to_first_byte_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    ttft[le] = ttft.get(le, 0.0) + sample.value
    return {"engine_prompt": sums["warmroute_engine_prompt_tokens"],
            "engine_cached": sums["warmroute_engine_cached_tokens"],
            "predicted_same": sums["warmroute_predicted_cached_tokens"],
            "answered": answered, "refused": refused,
            "ttft_le": [le for le in sorted(ttft) if le != float("inf")], "ttft": [ttft[le] for le in sorted(ttft)]}


def _totals(activity: Activity, metrics: Metrics) -> dict[str, Any]:
    """This worker's counters since start, which the timeline turns into rates (and sends to the others)."""
    return _metric_totals(metrics) | {"predicted": activity.predicted_tokens, "asked": activity.prompt_tokens}


def _engine_totals(metrics: Metrics) -> tuple[float, float, float]:
    """Sums over every backend: engine-reported prompt and cached tokens, and the router's prediction."""
    t = _metric_totals(metrics)
    return t["engine_prompt"], t["engine_cached"], t["predicted_same"]


def _counts(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    """A counter's totals by one of its labels (summed over the others)."""
    out: dict[str, float] = {}
    for family in metrics.registry.collect():
        if family.name == name:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels[label]
                    out[key] = out.get(key, 0.0) + sample.value
    return out


def _waiting(admission: Admission | None, others: list[dict[str, Any]]) -> dict[tuple[int, str], int]:
    """Requests waiting in the router's queue per (priority, tenant), over every worker."""
    waiting: dict[tuple[int, str], int] = dict(admission.depth()) if admission is not None else {}
    for snap in others:
        for priority, tenant, n in snap.get("queue", ()):
            waiting[(priority, tenant)] = waiting.get((priority, tenant), 0) + n
    return waiting


def _queue(admission: Admission | None, others: list[dict[str, Any]], metrics: Metrics) -> dict[str, Any]:
    """The router's admission queue: who waits now (by priority and tenant), and how requests were admitted
    or refused since start (this worker's counters)."""
    waiting = _waiting(admission, others)
    return {"enabled": admission is not None and admission.settings.enabled,
            "waiting": sum(waiting.values()),
            "by": [{"priority": p, "tenant": t, "waiting": n} for (p, t), n in sorted(waiting.items(), reverse=True)],
            "admitted": _counts(metrics, "warmroute_admissions", "how"),
            "shed": _counts(metrics, "warmroute_sheds", "reason")}


_SNAPSHOT_KEYS = frozenset({"pid", "instances", "predicted_tokens", "prompt_tokens", "engine_totals", "hot",
                            "total", "recent", "totals"})


def snapshot(fleet: Fleet, activity: Activity, metrics: Metrics,
             admission: Admission | None = None) -> dict[str, Any]:
    """This worker's own figures, for the other workers' pages (JSON; block hashes, names and counts only)."""
    totals = _totals(activity, metrics)
    return {
        "pid": os.getpid(),
        "instances": {i.name: [i.inflight, i.requests_total, i.inflight_prompt_tokens]
                      for i in fleet.instances.values()},
        "predicted_tokens": activity.predicted_tokens, "prompt_tokens": activity.prompt_tokens,
        "engine_totals": [totals["engine_prompt"], totals["engine_cached"], totals["predicted_same"]],
        "totals": totals,
        "hot": list(activity._counts.items()), "total": activity._total,
        "recent": list(activity.recent),
        "queue": [[p, t, n] for (p, t), n in admission.depth().items()] if admission is not None else [],
    }


def _load(fleet: Fleet, others: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per instance of this worker's fleet: in flight, requests and prompt tokens in flight, over every worker."""
    load = {i.name: [i.inflight, i.requests_total, i.inflight_prompt_tokens] for i in fleet.instances.values()}
    for snap in others:  # health and membership are this worker's; traffic is everyone's
        for name, (inflight, requests, prompt_tokens) in snap["instances"].items():
            if name in load:
                load[name][0] += inflight
                load[name][1] += requests
                load[name][2] += prompt_tokens
    return load


def state(fleet: Fleet, activity: Activity, metrics: Metrics, strategy: str,
          others: list[dict[str, Any]] = (), admission: Admission | None = None,
          timeline: Timeline | None = None) -> dict[str, Any]:
    """The page's JSON: this worker's figures plus the other workers' latest snapshots (`others`)."""
    now = time.time()
    load = _load(fleet, others)
    total = sum(r for _, r, _ in load.values()) or 1
    # KV demand: prompt tokens in flight over the instance's KV capacity, the ratio cache_aware compares with
    # hold_kv_limit and sticky_kv_limit (core/strategies.py kv_pressure); above 1, its engine evicts cached
    # prefixes of queued requests before their turn.
    instances = [{"name": i.name, "role": i.role, "healthy": i.healthy, "draining": i.draining,
                  "inflight": load[i.name][0],
                  "requests": load[i.name][1], "share": round(load[i.name][1] / total, 4),
                  "inflight_prompt_tokens": load[i.name][2],
                  "kv_demand": round(load[i.name][2] / max(1, i.kv_capacity_tokens), 4)}
                 for i in sorted(fleet.instances.values(), key=lambda i: i.name)]
    prompt, cached, predicted_same = _engine_totals(metrics)
    predicted, asked = activity.predicted_tokens, activity.prompt_tokens
    recent = list(activity.recent)
    for snap in others:
        p, c, s = snap["engine_totals"]
        prompt, cached, predicted_same = prompt + p, cached + c, predicted_same + s
        predicted, asked = predicted + snap["predicted_tokens"], asked + snap["prompt_tokens"]
        recent += [tuple(r) for r in snap["recent"]]
    recent = sorted(recent)[-RECENT:]
    return {
        "time": now,
        "strategy": strategy,
        "workers": 1 + len(others),
        "instances": instances,
        "hit_rate": {
            "predicted": round(predicted / asked, 4) if asked else None,
            "engine_reported": round(cached / prompt, 4) if prompt else None,
            "predicted_same_responses": round(predicted_same / prompt, 4) if prompt else None,
        },
        "hot_prefixes": activity.hot(others),
        "queue": _queue(admission, others, metrics),
        "recent_decisions": [{"age_s": round(now - t, 2), "instance": name, "reason": reason,
                              "matched_ratio": round(ratio, 3)}
                             for t, name, reason, ratio in reversed(recent)],
        "series": timeline.series() if timeline is not None else None,
        "disaggregation": _disaggregation(fleet, metrics) if fleet.disaggregated else None,
    }


def _disaggregation(fleet: Fleet, metrics: Metrics) -> dict[str, Any]:
    """This worker's split requests: decisions by why, legs by pool and outcome, tokens moved, and the prefill
    pool's engine-reported hit rate (its prefill legs' cached prompt tokens)."""
    prompt = _counts(metrics, "warmroute_engine_prompt_tokens", "backend")
    cached = _counts(metrics, "warmroute_engine_cached_tokens", "backend")
    prefill = [i.name for i in fleet.instances.values() if i.role == "prefill"]
    asked = sum(prompt.get(n, 0.0) for n in prefill)
    legs = _counts(metrics, "warmroute_pd_legs", "pool"), _counts(metrics, "warmroute_pd_legs", "outcome")
    transfer = metrics.registry.get_sample_value("warmroute_pd_transfer_tokens_total") or 0.0
    return {"decisions": _counts(metrics, "warmroute_pd_decisions", "why"), "legs_by_pool": legs[0],
            "legs_by_outcome": legs[1], "transfer_tokens": transfer,
            "prefill_hit_rate": round(sum(cached.get(n, 0.0) for n in prefill) / asked, 4) if asked else None}


_COUNTERS = ("engine_prompt", "engine_cached", "answered", "refused", "predicted", "asked")


class Timeline:
    """The charts' points in a ring of HISTORY_S / SAMPLE_EVERY_S: memory stays bounded whatever the traffic
    (points x instances). Each point holds the counters' rates since the previous sample, summed over every
    worker's totals (a worker's own deltas, so that one leaving or restarting never shows as a drop), and the
    gauges (queue, in flight) at the sample."""

    def __init__(self, interval: float | None = None, window: float = HISTORY_S) -> None:
        self.interval = SAMPLE_EVERY_S if interval is None else interval
        self.points: deque[dict[str, Any]] = deque(maxlen=max(2, round(window / self.interval)))
        self._last: dict[int, dict[str, Any]] = {}  # pid -> its totals at the previous sample
        self._last_at: float | None = None

    def sample(self, own: dict[str, Any], inflight: dict[str, int], waiting: int,
               others: list[dict[str, Any]] = (), now: float | None = None) -> None:
        now = time.time() if now is None else now
        sources = {os.getpid(): own} | {snap["pid"]: snap["totals"] for snap in others}
        sums = dict.fromkeys(_COUNTERS, 0.0)
        ttft = [0.0] * len(own["ttft"])
        for pid, totals in sources.items():
            prev = self._last.get(pid)
            if prev is None or any(totals[k] < prev[k] for k in _COUNTERS) or len(totals["ttft"]) != len(ttft):
                continue  # first seen (or restarted): its totals are the baseline of the next point
            for k in _COUNTERS:
                sums[k] += totals[k] - prev[k]
            ttft = [a + b - c for a, b, c in zip(ttft, totals["ttft"], prev["ttft"])]
        self._last = sources  # a worker gone is forgotten: the map stays as small as the workers
        last_at, self._last_at = self._last_at, now
        if last_at is None or now <= last_at:
            return
        dt = now - last_at
        self.points.append({
            "t": now,
            "hit_predicted": sums["predicted"] / sums["asked"] if sums["asked"] else None,
            "hit_engine": sums["engine_cached"] / sums["engine_prompt"] if sums["engine_prompt"] else None,
            "ttft_p50": _quantile(0.5, own["ttft_le"], ttft), "ttft_p99": _quantile(0.99, own["ttft_le"], ttft),
            "rps": sums["answered"] / dt, "refused": sums["refused"] / dt,
            "waiting": waiting, "inflight": inflight})

    def series(self) -> dict[str, Any]:
        """The points as columns (the page's JSON), with the busiest instances' in-flight lines."""
        points = list(self.points)

        def column(key: str, digits: int) -> list[float | None]:
            return [None if p[key] is None else round(p[key], digits) for p in points]

        peak: dict[str, int] = {}
        for p in points:
            for name, n in p["inflight"].items():
                peak[name] = max(peak.get(name, 0), n)
        shown = sorted(sorted(peak), key=lambda n: -peak[n])[:INSTANCE_LINES]
        inflight = {name: [p["inflight"].get(name, 0) for p in points] for name in sorted(shown)}
        if len(peak) > len(shown):
            inflight["others"] = [sum(n for name, n in p["inflight"].items() if name not in inflight) for p in points]
        return {"interval_s": self.interval, "window_s": self.interval * (self.points.maxlen or 0),
                "t": column("t", 2), "hit_predicted": column("hit_predicted", 4),
                "hit_engine": column("hit_engine", 4), "ttft_p50_s": column("ttft_p50", 4),
                "ttft_p99_s": column("ttft_p99", 4), "requests_per_s": column("rps", 3),
                "refused_per_s": column("refused", 3), "queue_waiting": [p["waiting"] for p in points],
                "inflight": inflight}


def _quantile(q: float, bounds: list[float], cumulative: list[float]) -> float | None:
    """A quantile from a histogram's cumulative bucket counts (the last one +Inf), interpolated within its bucket
    as Prometheus's histogram_quantile does; None without observations."""
    total = cumulative[-1] if cumulative else 0.0
    if total <= 0:
        return None
    rank = q * total
    for i, count in enumerate(cumulative):
        if count >= rank:
            if i >= len(bounds):  # in the +Inf bucket: the highest bound is all that is known
                return bounds[-1]
            lower, below = (bounds[i - 1], cumulative[i - 1]) if i else (0.0, 0.0)
            return lower + (bounds[i] - lower) * (rank - below) / (count - below) if count > below else bounds[i]
    return bounds[-1]


class TimelineSampler(Periodic):
    """Every `timeline.interval` seconds, a point of the router's figures (this worker's and the others' latest
    snapshots) for the charts."""

    name = "dashboard-timeline"

    def __init__(self, timeline: Timeline, fleet: Fleet, activity: Activity, metrics: Metrics,
                 siblings: Siblings, admission: Admission | None) -> None:
        super().__init__(timeline.interval)
        self.timeline, self.fleet, self.activity, self.metrics = timeline, fleet, activity, metrics
        self.siblings, self.admission = siblings, admission

    async def round(self) -> None:
        others = self.siblings.fresh()
        load = _load(self.fleet, others)
        self.timeline.sample(_totals(self.activity, self.metrics), {name: v[0] for name, v in load.items()},
                             sum(_waiting(self.admission, others).values()), others)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>warmroute</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:16px;background:#f6f7f9;color:#1d2330}
h1{font-size:20px;margin:0 0 12px} h2{font-size:15px;margin:0 0 8px}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:14px}
.card{background:#fff;border-radius:8px;padding:12px 14px;box-shadow:0 1px 3px #0002}
table{border-collapse:collapse;width:100%} td,th{text-align:left;padding:3px 6px;border-bottom:1px solid #e4e7ec}
.ok{color:#137333;font-weight:600}.bad{color:#b3261e;font-weight:600}.drain{color:#a05a00;font-weight:600}
.big{font-size:28px;font-weight:700}.muted{color:#667}
.bar{height:10px;background:#3b6fd8;border-radius:3px}
.wide{grid-column:1/-1} .charts{display:grid;grid-template-columns:repeat(3,1fr);gap:10px 18px}
.chart h3{font-size:13px;margin:0;font-weight:600} .chart svg{width:100%;height:auto;display:block}
.legend{font-size:12px;color:#445;min-height:17px} .legend span{margin-right:10px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:3px;margin:0 4px 3px 0;vertical-align:middle}
svg .axis{font-size:10px;fill:#778} svg .grid{stroke:#e4e7ec;stroke-width:1}
svg .series{fill:none;stroke-width:1.8;stroke-linejoin:round}
@media(max-width:800px){.charts{grid-template-columns:1fr}}
</style></head><body>
<h1>warmroute <span class="muted" id="strategy"></span> <span class="muted" id="updated"></span></h1>
<div class="grid">
 <div class="card wide"><h2>Last <span id="window">10 minutes</span> <span class="muted" id="interval"></span></h2>
  <div class="charts" id="charts"></div></div>
 <div class="card"><h2>Hit rate</h2>
  <div>predicted <span class="big" id="hit-predicted">-</span></div>
  <div>engine-reported <span class="big" id="hit-engine">-</span>
   <span class="muted">(router predicted <span id="hit-same">-</span> for the same responses)</span></div></div>
 <div class="card"><h2>Instances</h2><table><thead><tr><th>name</th><th>state</th><th>in flight</th>
  <th>requests</th><th>share</th><th title="prompt tokens in flight / KV capacity: above 100%, queued requests'
  cached prefixes are evicted before their turn">KV demand</th></tr></thead><tbody id="instances"></tbody></table></div>
 <div class="card" id="pd-card" hidden><h2>Disaggregated prefill/decode</h2>
  <div>prefill pool hit rate <span class="big" id="pd-hit">-</span></div>
  <div class="muted" id="pd-decisions"></div><div class="muted" id="pd-legs"></div>
  <div class="muted" id="pd-transfer"></div></div>
 <div class="card"><h2>Waiting in the router <span class="muted" id="queue-total"></span></h2>
  <div class="muted" id="queue-counts"></div><table><thead><tr><th>priority</th><th>tenant</th><th>waiting</th></tr>
  </thead><tbody id="queue"></tbody></table></div>
 <div class="card"><h2>Hottest prefixes (share of traffic)</h2><table><thead><tr><th>prefix id</th><th>share</th>
  <th></th></tr></thead><tbody id="hot"></tbody></table></div>
 <div class="card"><h2>Recent decisions</h2><table><thead><tr><th>age</th><th>instance</th><th>reason</th>
  <th>predicted cached</th></tr></thead><tbody id="decisions"></tbody></table></div>
</div>
<script>
"use strict";
const pct = x => x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%";
function cell(tr, text, cls) { const td = document.createElement("td"); td.textContent = text;
  if (cls) td.className = cls; tr.appendChild(td); return td; }
function rows(id, items, fill) { const body = document.getElementById(id); const out = [];
  for (const item of items) { const tr = document.createElement("tr"); fill(tr, item); out.push(tr); }
  body.replaceChildren(...out); }
function render(s) {
  document.getElementById("strategy").textContent = "strategy " + s.strategy +
    (s.workers > 1 ? " \u00b7 " + s.workers + " workers" : "");
  document.getElementById("updated").textContent = "updated " + new Date(s.time * 1000).toLocaleTimeString();
  document.getElementById("hit-predicted").textContent = pct(s.hit_rate.predicted);
  document.getElementById("hit-engine").textContent = pct(s.hit_rate.engine_reported);
  document.getElementById("hit-same").textContent = pct(s.hit_rate.predicted_same_responses);
  rows("instances", s.instances, (tr, i) => {
    cell(tr, i.role && i.role !== "both" ? i.name + " (" + i.role + ")" : i.name);
    if (i.draining) cell(tr, "draining", "drain"); else cell(tr, i.healthy ? "healthy" : "ejected", i.healthy ? "ok" : "bad");
    cell(tr, String(i.inflight)); cell(tr, String(i.requests)); cell(tr, pct(i.share));
    cell(tr, pct(i.kv_demand), i.kv_demand > 1 ? "bad" : ""); });
  rows("hot", s.hot_prefixes, (tr, p) => { cell(tr, p.prefix); cell(tr, pct(p.share));
    const bar = document.createElement("div"); bar.className = "bar"; bar.style.width = Math.round(200 * p.share) + "px";
    cell(tr, "").appendChild(bar); });
  const pd = s.disaggregation, line = o => Object.entries(o).map(([k, v]) => k + " " + v).join(", ") || "none";
  document.getElementById("pd-card").hidden = !pd;
  if (pd) {
    document.getElementById("pd-hit").textContent = pct(pd.prefill_hit_rate);
    document.getElementById("pd-decisions").textContent = "requests: " + line(pd.decisions);
    document.getElementById("pd-legs").textContent = "legs: " + line(pd.legs_by_pool) + " \u00b7 " + line(pd.legs_by_outcome);
    document.getElementById("pd-transfer").textContent = "prompt tokens moved: " + pd.transfer_tokens; }
  const q = s.queue, sum = o => Object.entries(o).map(([k, v]) => k + " " + v).join(", ") || "none";
  document.getElementById("queue-total").textContent = q.enabled ? String(q.waiting) : "(admission off)";
  document.getElementById("queue-counts").textContent = "admitted: " + sum(q.admitted) + " \u00b7 refused: " + sum(q.shed);
  rows("queue", q.by, (tr, w) => { cell(tr, String(w.priority)); cell(tr, w.tenant || "(none)"); cell(tr, String(w.waiting)); });
  rows("decisions", s.recent_decisions, (tr, d) => { cell(tr, d.age_s.toFixed(1) + " s"); cell(tr, d.instance);
    cell(tr, d.reason); cell(tr, pct(d.matched_ratio)); });
  renderCharts(s.series);
}
const SVG = "http://www.w3.org/2000/svg", W = 360, H = 110, L = 44, R = 6, T = 6, B = 16;
const COLOURS = ["#3b6fd8", "#e07b39", "#2e9e5b", "#9b4dca", "#c23b6f", "#00838f", "#8a7a00", "#8d6e63", "#667"];
const num = (x, d) => x === null || x === undefined ? "-" : x.toFixed(d);
const count = x => x === null || x === undefined ? "-" : Number.isInteger(x) ? String(x) : x.toFixed(1);
const ms = x => x === null || x === undefined ? "-" : x < 1 ? Math.round(1000 * x) + " ms" : x.toFixed(2) + " s";
// Each chart: its lines from the state's series, how a value reads, and a fixed top (hit rates) or none.
const CHARTS = [
  ["hit", "Hit rate", s => [["predicted", s.hit_predicted], ["engine-reported", s.hit_engine]], pct, 1],
  ["ttft", "Time to first token at the router", s => [["p50", s.ttft_p50_s], ["p99", s.ttft_p99_s]], ms],
  ["throughput", "Throughput", s => [["requests", s.requests_per_s]], x => num(x, 1) + "/s"],
  ["queue", "Waiting in the router", s => [["waiting", s.queue_waiting]], count],
  ["refused", "Refused (429)", s => [["429s", s.refused_per_s]], x => num(x, 2) + "/s"],
  ["inflight", "In flight per instance", s => Object.entries(s.inflight), count],
];
function el(parent, name, attrs, text) { const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text; parent.appendChild(e); return e; }
function niceTop(v) { if (!(v > 0)) return 1; const p = Math.pow(10, Math.floor(Math.log10(v)));
  return [1, 2, 2.5, 5, 10].map(m => m * p).find(m => m >= v); }
function drawChart(box, t, lines, fmt, top) {
  const svg = document.createElementNS(SVG, "svg"); svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.dataset.chart = box.dataset.chart;
  const values = lines.flatMap(([, v]) => v).filter(v => v !== null);
  top = top || niceTop(Math.max(0, ...values));
  const t0 = t[0], span = Math.max(1, t[t.length - 1] - t0);
  const x = tt => (L + (W - L - R) * (tt - t0) / span).toFixed(1);
  const y = v => (T + (H - T - B) * (1 - v / top)).toFixed(1);
  for (const v of [0, top / 2, top]) { el(svg, "line", {x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid"});
    el(svg, "text", {x: L - 4, y: +y(v) + 3, "text-anchor": "end", class: "axis"}, fmt(v)); }
  el(svg, "text", {x: L, y: H - 3, class: "axis"}, "-" + Math.round(span / 60 * 10) / 10 + " min");
  el(svg, "text", {x: W - R, y: H - 3, "text-anchor": "end", class: "axis"}, "now");
  const legend = box.querySelector(".legend"); legend.replaceChildren();
  lines.forEach(([name, v], k) => {
    const colour = COLOURS[k % COLOURS.length];
    let run = [];  // a gap (no data in an interval) breaks the line
    const flush = () => { if (run.length > 1) el(svg, "polyline", {points: run.join(" "), class: "series",
      stroke: colour, "data-series": name});
      else if (run.length) { const [cx, cy] = run[0].split(","); el(svg, "circle", {cx, cy, r: 2, fill: colour}); }
      run = []; };
    v.forEach((val, i) => { if (val === null) flush(); else run.push(x(t[i]) + "," + y(Math.min(val, top))); });
    flush();
    const last = [...v].reverse().find(val => val !== null);
    const item = document.createElement("span"), swatch = document.createElement("i");
    swatch.style.background = colour; item.append(swatch, name + " " + (last === undefined ? "-" : fmt(last)));
    legend.appendChild(item); });
  box.querySelector("svg").replaceWith(svg);
}
function renderCharts(s) {
  const root = document.getElementById("charts");
  if (!s) { root.textContent = "off"; return; }
  document.getElementById("window").textContent = Math.round(s.window_s / 60) + " minutes";
  document.getElementById("interval").textContent = "(a point every " + s.interval_s + " s)";
  for (const [id, title, lines, fmt, top] of CHARTS) {
    let box = root.querySelector(`[data-chart="${id}"]`);
    if (!box) { box = document.createElement("div"); box.className = "chart"; box.dataset.chart = id;
      const h = document.createElement("h3"); h.textContent = title; const legend = document.createElement("div");
      legend.className = "legend"; const empty = el(box, "svg", {viewBox: `0 0 ${W} ${H}`});
      el(empty, "text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "axis"},
         "collecting: a line needs two points");
      box.prepend(h, legend); root.appendChild(box); }
    if (s.t.length > 1) drawChart(box, s.t, lines(s), fmt, top);
  }
}
async function poll() {
  try { const r = await fetch("dashboard/state", {cache: "no-store"}); if (r.ok) render(await r.json()); }
  catch (e) { document.getElementById("updated").textContent = "router unreachable"; }
}
poll(); setInterval(poll, 1000);
</script></body></html>
"""


async def page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html",
                        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                                 "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                                            "style-src 'unsafe-inline'"})
