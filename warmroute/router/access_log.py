"""The access log (setting `access_log`, off by default): one JSON line per request on stdout.

Why a request went where it went, for the operator who asks: the instance and the reason of the routing
decision (after a retry, the instance that answered), the share of the prompt the router predicted cached,
the status, the time to the instance's first byte and the whole duration, and how long it waited in the router
for room (`queued_ms`, only when it did: the admission queue). Never prompt text, query strings
or headers (they carry API keys); the client's address, as any access log has it.

aiohttp calls `log` once per request after its response, error answers included (aiohttp's own access log
machinery, with this class as its format).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import datetime, timezone

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, RequestKey, StreamResponse

from warmroute.core.strategies import Decision

LOGGER = "warmroute.access"
# What the app and the proxy note on the request for this log: the (last) routing decision and how many
# instances were tried, when the request's handling began and when the instance's first byte arrived
# (perf_counter).
DECISION = RequestKey("warmroute_decision", Decision)
ATTEMPTS = RequestKey("warmroute_attempts", int)
STARTED = RequestKey("warmroute_started", float)
FIRST_BYTE = RequestKey("warmroute_first_byte", float)
PREFILL = RequestKey("warmroute_prefill", str)  # where a split request's prefill leg went (router/disaggregated.py)
WAITED = RequestKey("warmroute_waited", float)  # seconds it waited in the router's queue (Router.admit), if it did
HELD = RequestKey("warmroute_held", float)  # seconds held for another's prefill (Router.hold_for_prefill), if it was


class JsonAccessLogger(AbstractAccessLogger):
    def log(self, request: BaseRequest, response: StreamResponse, time_s: float) -> None:
        started = request.get(STARTED)
        if started is not None:  # aiohttp's `time_s` comes from the event loop's clock: 1 ms steps on uvloop
            time_s = time.perf_counter() - started
        line: dict[str, object] = {
            "ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "client": request.remote,
            "method": request.method,
            "path": request.path,
            "status": response.status,
            "ms": round(time_s * 1000, 3),
            "bytes": response.body_length,
        }
        decision: Decision | None = request.get(DECISION)
        if decision is not None:
            line.update(instance=decision.instance, reason=decision.reason, prompt_tokens=decision.prompt_tokens,
                        predicted_cached=round(decision.matched_ratio, 4), attempts=request.get(ATTEMPTS, 1))
            if decision.match:  # precise mode: the engine's events or the router's model predicted it
                line["match"] = decision.match
            if decision.note:  # precise mode could not tokenize it
                line["note"] = decision.note
            first = request.get(FIRST_BYTE)
            if started is not None and first is not None:
                line["ttfb_ms"] = round((first - started) * 1000, 3)
            waited = request.get(WAITED)
            if waited is not None:
                line["queued_ms"] = round(waited * 1000, 3)
            held = request.get(HELD)
            if held is not None:
                line["held_ms"] = round(held * 1000, 3)
        self.logger.info(json.dumps(line, separators=(",", ":")))


def access_logger(enabled: bool) -> logging.Logger | None:
    """The logger aiohttp writes to (None: no access log): JSON lines alone on stdout, whatever the
    format of the router's other logs (stderr)."""
    if not enabled:
        return None
    logger = logging.getLogger(LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger
