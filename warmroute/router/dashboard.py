"""The live status page: GET /dashboard (plain HTML + JS, no build step) polls GET /dashboard/state every second.

What it shows: instances (health, draining, in flight, requests), the predicted and engine-reported hit
rates, the requests waiting in the router's admission queue (by priority and tenant) with the admitted and
refused counts, the hottest prefixes by share of recent traffic, and the latest routing decisions. Never prompt text
and never addresses: a prefix is shown as a keyed hash of its first KiB (a fresh random key per `warmroute
serve`, so the ids cannot be matched against a dictionary of known prompts), a decision as instance name and
reason.

With `workers` > 1 each worker sends the others a snapshot of its own figures every second (`snapshot`, over
the local sockets of shared_index.WorkerLinks) and the one that answers /dashboard/state adds them to its own:
the page shows the whole router, whichever worker the poll reaches. The key is made once, before the workers
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
from warmroute.router.metrics import Metrics

HOT_SLOTS = 64  # prefixes counted (Space-Saving: the heavy hitters are kept, the tail shares the rest)
HOT_SHOWN = 10
RECENT = 30  # decisions shown
HALVE_EVERY = 20_000  # requests: counts are halved so the shares follow recent traffic
PREFIX_BYTES = 1024  # a prefix is identified by its first KiB
SNAPSHOT_EVERY_S = 1.0  # workers > 1: how often a worker sends its figures to the others
SNAPSHOT_FRESH_S = 5.0  # a sibling's snapshot older than this is left out (the worker is gone or stuck)
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


def _engine_totals(metrics: Metrics) -> tuple[float, float, float]:
    """Sums over every backend: engine-reported prompt and cached tokens, and the router's prediction."""
    sums = {"warmroute_engine_prompt_tokens": 0.0, "warmroute_engine_cached_tokens": 0.0,
            "warmroute_predicted_cached_tokens": 0.0}
    for family in metrics.registry.collect():
        if family.name in sums:
            sums[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return (sums["warmroute_engine_prompt_tokens"], sums["warmroute_engine_cached_tokens"],
            sums["warmroute_predicted_cached_tokens"])


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


def _queue(admission: Admission | None, others: list[dict[str, Any]], metrics: Metrics) -> dict[str, Any]:
    """The router's admission queue: who waits now (by priority and tenant), and how requests were admitted
    or refused since start (this worker's counters)."""
    waiting: dict[tuple[int, str], int] = dict(admission.depth()) if admission is not None else {}
    for snap in others:
        for priority, tenant, n in snap.get("queue", ()):
            waiting[(priority, tenant)] = waiting.get((priority, tenant), 0) + n
    return {"enabled": admission is not None and admission.settings.enabled,
            "waiting": sum(waiting.values()),
            "by": [{"priority": p, "tenant": t, "waiting": n} for (p, t), n in sorted(waiting.items(), reverse=True)],
            "admitted": _counts(metrics, "warmroute_admissions", "how"),
            "shed": _counts(metrics, "warmroute_sheds", "reason")}


_SNAPSHOT_KEYS = frozenset({"pid", "instances", "predicted_tokens", "prompt_tokens", "engine_totals", "hot",
                            "total", "recent"})


def snapshot(fleet: Fleet, activity: Activity, metrics: Metrics,
             admission: Admission | None = None) -> dict[str, Any]:
    """This worker's own figures, for the other workers' pages (JSON; block hashes, names and counts only)."""
    return {
        "pid": os.getpid(),
        "instances": {i.name: [i.inflight, i.requests_total, i.inflight_prompt_tokens]
                      for i in fleet.instances.values()},
        "predicted_tokens": activity.predicted_tokens, "prompt_tokens": activity.prompt_tokens,
        "engine_totals": list(_engine_totals(metrics)),
        "hot": list(activity._counts.items()), "total": activity._total,
        "recent": list(activity.recent),
        "queue": [[p, t, n] for (p, t), n in admission.depth().items()] if admission is not None else [],
    }


def state(fleet: Fleet, activity: Activity, metrics: Metrics, strategy: str,
          others: list[dict[str, Any]] = (), admission: Admission | None = None) -> dict[str, Any]:
    """The page's JSON: this worker's figures plus the other workers' latest snapshots (`others`)."""
    now = time.time()
    load = {i.name: [i.inflight, i.requests_total, i.inflight_prompt_tokens] for i in fleet.instances.values()}
    for snap in others:  # health and membership are this worker's; traffic is everyone's
        for name, (inflight, requests, prompt_tokens) in snap["instances"].items():
            if name in load:
                load[name][0] += inflight
                load[name][1] += requests
                load[name][2] += prompt_tokens
    total = sum(r for _, r, _ in load.values()) or 1
    # KV demand: prompt tokens in flight over the instance's KV capacity, the ratio cache_aware compares with
    # hold_kv_limit and sticky_kv_limit (core/strategies.py kv_pressure); above 1, its engine evicts cached
    # prefixes of queued requests before their turn.
    instances = [{"name": i.name, "healthy": i.healthy, "draining": i.draining, "inflight": load[i.name][0],
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
    }


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
</style></head><body>
<h1>warmroute <span class="muted" id="strategy"></span> <span class="muted" id="updated"></span></h1>
<div class="grid">
 <div class="card"><h2>Hit rate</h2>
  <div>predicted <span class="big" id="hit-predicted">-</span></div>
  <div>engine-reported <span class="big" id="hit-engine">-</span>
   <span class="muted">(router predicted <span id="hit-same">-</span> for the same responses)</span></div></div>
 <div class="card"><h2>Instances</h2><table><thead><tr><th>name</th><th>state</th><th>in flight</th>
  <th>requests</th><th>share</th><th title="prompt tokens in flight / KV capacity: above 100%, queued requests'
  cached prefixes are evicted before their turn">KV demand</th></tr></thead><tbody id="instances"></tbody></table></div>
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
    cell(tr, i.name);
    if (i.draining) cell(tr, "draining", "drain"); else cell(tr, i.healthy ? "healthy" : "ejected", i.healthy ? "ok" : "bad");
    cell(tr, String(i.inflight)); cell(tr, String(i.requests)); cell(tr, pct(i.share));
    cell(tr, pct(i.kv_demand), i.kv_demand > 1 ? "bad" : ""); });
  rows("hot", s.hot_prefixes, (tr, p) => { cell(tr, p.prefix); cell(tr, pct(p.share));
    const bar = document.createElement("div"); bar.className = "bar"; bar.style.width = Math.round(200 * p.share) + "px";
    cell(tr, "").appendChild(bar); });
  const q = s.queue, sum = o => Object.entries(o).map(([k, v]) => k + " " + v).join(", ") || "none";
  document.getElementById("queue-total").textContent = q.enabled ? String(q.waiting) : "(admission off)";
  document.getElementById("queue-counts").textContent = "admitted: " + sum(q.admitted) + " \u00b7 refused: " + sum(q.shed);
  rows("queue", q.by, (tr, w) => { cell(tr, String(w.priority)); cell(tr, w.tenant || "(none)"); cell(tr, String(w.waiting)); });
  rows("decisions", s.recent_decisions, (tr, d) => { cell(tr, d.age_s.toFixed(1) + " s"); cell(tr, d.instance);
    cell(tr, d.reason); cell(tr, pct(d.matched_ratio)); });
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
