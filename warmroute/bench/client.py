"""One streamed request: POST, read the Server-Sent Events, time the first content and the end."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from warmroute.bench.stats import RequestRecord
from warmroute.workloads import WorkloadRequest

INSTANCE_HEADER = "x-warmroute-instance"
TENANT_HEADER = "x-tenant"  # the router's default tenant_header
PREDICTED_HEADER = "x-warmroute-predicted-hit"
REASON_HEADER = "x-warmroute-reason"  # "cache_hit; queued=0.153s" when it waited in the router


def streaming_body(req: WorkloadRequest, model: str | None) -> dict[str, Any]:
    """The workload's body, streamed with usage in the final chunk (and the served model's name)."""
    body = {**req.body, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    return body


async def send(session: aiohttp.ClientSession, base_url: str, req: WorkloadRequest, *, model: str | None,
               t0: float, timeout_s: float) -> RequestRecord:
    """Issue `req` and measure it; never raises for a failed request (the record says what went wrong)."""
    start = time.perf_counter()
    rec = RequestRecord(tag=req.tag, start_s=start - t0, tenant=req.tenant)
    headers = {TENANT_HEADER: req.tenant} if req.tenant else None
    try:
        async with session.post(base_url + req.path, json=streaming_body(req, model), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            rec.instance = resp.headers.get(INSTANCE_HEADER)
            rec.predicted_hit = _ratio(resp.headers.get(PREDICTED_HEADER))
            rec.queued_s = _queued(resp.headers.get(REASON_HEADER, ""))
            if resp.status != 200:
                await resp.read()
                rec.error = f"http_{resp.status}"
                return rec
            await _read_stream(resp, rec, start)
    except asyncio.TimeoutError:
        rec.error = "timeout"
    except aiohttp.ClientConnectorError:
        rec.error = "connect"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError):
        rec.error = "disconnected"
    except aiohttp.ClientError as exc:
        rec.error = exc.__class__.__name__
    return rec


def _queued(reason: str) -> float | None:
    """The seconds a request waited in the router, from its x-warmroute-reason ("...; queued=0.153s")."""
    for part in reason.split(";"):
        name, _, value = part.strip().partition("=")
        if name == "queued" and value.endswith("s"):
            try:
                return float(value[:-1])
            except ValueError:
                return None
    return None


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, start: float) -> None:
    chunks = 0
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event names
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        try:
            event = json.loads(payload)
        except ValueError:
            rec.error = "bad_sse"
            return
        if _has_content(event):
            chunks += 1
            if rec.ttft_s is None:
                rec.ttft_s = time.perf_counter() - start
        if isinstance(event.get("usage"), dict):
            _read_usage(event["usage"], rec)
        if isinstance(event.get("error"), dict):
            rec.error = "stream_error"
            return
    rec.e2e_s = time.perf_counter() - start
    rec.output_tokens = rec.output_tokens or chunks
    if rec.ttft_s is None:
        rec.error = "no_content"


def _ratio(value: str | None) -> float | None:
    try:
        ratio = float(value) if value is not None else None
    except ValueError:
        return None
    return ratio if ratio is not None and 0.0 <= ratio <= 1.0 else None


def _has_content(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


def _read_usage(usage: dict[str, Any], rec: RequestRecord) -> None:
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.output_tokens = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        rec.cached_tokens = details["cached_tokens"]
