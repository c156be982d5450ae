"""Forwarding one request to the chosen instance and relaying its answer, chunk by chunk.

The original body bytes go upstream unchanged; the answer comes back unchanged (no decompression, no
re-serialisation), each chunk written to the client the moment it arrives, so SSE streams are never buffered.
Every failure is bounded by a timeout and ends the upstream connection, so the engine stops working on a
request nobody waits for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from urllib.parse import urlsplit

import msgspec

from warmroute.core.disaggregation import DECODE, PREFILL, Plan
from warmroute.core.lifecycle import Leg, Lifecycle, State
from warmroute.core.strategies import Decision, NoInstanceAvailable
from warmroute.router import access_log as access
from warmroute.router.errors import ApiError
from warmroute.router.connections import Upstreams
from warmroute.router.disaggregated import (MAX_PREFILL_ANSWER, bootstrap_fields, prefill_body, transfer_params,
                                            with_fields)
from warmroute.router.health import Health
from warmroute.router.members import Addresses, Member
from warmroute.router.routing import Router, is_routed
from warmroute.router.settings import RouterSettings
from warmroute.router.upstream import ConnectError, UpstreamError, UpstreamResponse
from warmroute.router.usage import UsageTap, parse_usage

log = logging.getLogger("warmroute.router")

# Hop-by-hop headers (RFC 9110 7.6.1) describe one connection, not the message: never forwarded.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                        "proxy-connection", "proxy-authenticate", "proxy-authorization"})
# Content-Encoding: aiohttp decompressed the body as it read it (app.py), so it goes up as plain bytes.
_NOT_FORWARDED_UP = HOP_BY_HOP | {"host", "content-length", "expect", "content-encoding"}
PREFILL_INSTANCE = "x-warmroute-prefill-instance"  # where a split request's prefill leg went
_NOT_FORWARDED_DOWN = HOP_BY_HOP | {"content-length", "x-warmroute-instance", "x-warmroute-reason",
                                    "x-warmroute-predicted-hit", PREFILL_INSTANCE}
CLIENT_CLOSED = 499  # status label of a request whose client went away (nginx's convention)


_DIRECT_LIMIT = 64 * 1024  # client write buffer beyond which chunks go through aiohttp's write (which drains)


def _direct_writer(request: web.Request, resp: web.StreamResponse, tap: UsageTap | None) -> Callable[[bytes], bool]:
    """A sink for UpstreamResponse.read_chunk: writes a relayed chunk to the client's socket in the upstream
    socket's own callback instead of waking the relay task for each chunk of a stream (64 paced streams: 0.16
    instead of 0.18 router cores; the rest is the socket wake-ups themselves), framed as aiohttp framed the
    headers it sent. Refuses (False) when the client is gone or not keeping up, so the relay task takes over and
    aiohttp's write waits for the client."""
    transport = request.transport
    chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"

    def write(data: bytes) -> bool:
        if transport is None or transport.is_closing() or transport.get_write_buffer_size() > _DIRECT_LIMIT:
            return False
        if tap is not None:
            tap.feed(data)
        if chunked:
            transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            transport.write(data)
        return True

    return write


class _Relayed(web.StreamResponse):
    """A relayed answer: prepared only once its first chunk is here, so its headers go out in the same write
    as that chunk (aiohttp's StreamResponse otherwise sends them on their own, one more send() and packet)."""

    _send_headers_immediately = False


class _ConnectFailed(Exception):
    """No connection could be opened: nothing was sent, so another instance may safely be tried."""

    def __init__(self, error: ConnectError) -> None:
        super().__init__(str(error))
        self.error = error


class _NoAnswer(Exception):
    """The instance took the request but sent no byte of an answer (first-byte timeout, or it dropped the
    connection): nothing reached the client either, so another instance may be tried. `error` is the answer
    if none can."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


def _filter(headers: CIMultiDictProxy[str] | CIMultiDict[str], drop: frozenset[str]) -> list[tuple[str, str]]:
    connection = headers.getall("Connection", ())
    if connection:  # headers named by Connection are hop-by-hop too
        drop = drop | {h.strip().lower() for v in connection for h in v.split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in drop]


def _target(request: web.Request) -> str:
    """Path and query to request upstream. Only these come from the client; the host never does."""
    raw = request.raw_path
    return raw if raw.startswith("/") else request.rel_url.raw_path_qs  # absolute-form: keep its path


class Proxy(Addresses):
    """Follows membership (members.py) for where each instance is: an address never comes from the request."""

    def __init__(self, router: Router, health: Health, upstreams: Upstreams, settings: RouterSettings) -> None:
        super().__init__()
        self.router = router
        self.health = health
        self.upstreams = upstreams
        self.settings = settings
        self._forwarding: set[asyncio.Task] = set()
        self.bootstrap_ports: dict[str, int | None] = {}  # SGLang's, per instance (its backend's bootstrap_port)

    def added(self, member: Member) -> None:
        super().added(member)
        self.bootstrap_ports[member.name] = member.backend.bootstrap_port

    def changed(self, member: Member) -> None:
        super().changed(member)
        self.bootstrap_ports[member.name] = member.backend.bootstrap_port

    def removed(self, name: str) -> None:
        super().removed(name)
        self.bootstrap_ports.pop(name, None)

    async def forward(self, request: web.Request, body: bytes, life: Lifecycle, decision: Decision,
                      plan: Plan | None = None) -> web.StreamResponse:
        """Forward one request and relay its answer (see `_forward`; a split request: `_forward_split`), tracked
        until it is done."""
        task = asyncio.current_task()
        assert task is not None
        self._forwarding.add(task)  # so a shutdown deadline can cut what is still running
        try:
            if plan is not None:
                plan.decode.note = "; ".join(filter(None, (plan.decode.note, f"pd={plan.why}")))
            if plan is not None and plan.prefill is not None:
                return await self._forward_split(request, body, life, plan)
            return await self._forward(request, body, life, decision)
        finally:
            self._forwarding.discard(task)
            life.close()

    # -- a split request (core/disaggregation.py, router/disaggregated.py) ---------------------------------------
    async def _forward_split(self, request: web.Request, body: bytes, life: Lifecycle,
                             plan: Plan) -> web.StreamResponse:
        """The prefill leg, then the decode leg with what it returned (or both at once, SGLang's bootstrap); a
        prefill leg that fails is tried once more at another prefill instance, then the request goes whole to its
        decode instance."""
        assert plan.prefill is not None
        parsed = msgspec.json.decode(body)  # it parsed when keyed
        transfer = self.settings.pd_transfer
        if transfer == "bootstrap":
            return await self._forward_bootstrap(request, body, parsed, life, plan)
        prefilled, params = await self._prefill(request, prefill_body(parsed, transfer), life, plan)
        if not prefilled:
            return await self._forward(request, body, life, plan.decode)
        assert life.key is not None
        prefill = request[access.PREFILL] = life.leg_at(PREFILL).instance  # type: ignore[union-attr]
        try:
            decode = self.router.decode_after(life.key, prefill)
            decode.note = plan.decode.note
        except NoInstanceAvailable:
            decode = plan.decode
        nixl = params is not None and transfer == "nixl"  # a storage connector's engines find the KV themselves
        leg_body = with_fields(parsed, {"kv_transfer_params": params}) if nixl else body
        return await self._forward(request, body, life, decode, leg_body, DECODE)

    async def _prefill(self, request: web.Request, leg_body: bytes, life: Lifecycle,
                       plan: Plan) -> tuple[bool, dict | None]:
        """Runs the prefill leg (at most two instances); (whether one answered, its transfer parameters)."""
        decision = plan.prefill
        assert decision is not None and life.key is not None
        for _ in (0, 1):
            leg = self.router.dispatch(life, decision, defer_record=True, role=PREFILL)
            await self.router.hold_for_prefill(life, leg)
            answer = await self._side_answer(request, leg_body, decision)
            if answer is not None:
                life.first_token()
                usage = parse_usage(answer.decode("utf-8", "replace"))
                if usage is not None:
                    self.router.engine_usage(life, usage)
                life.handover()
                self.router.metrics.pd_leg(PREFILL, "ok")
                return True, transfer_params(answer)
            life.retry()
            self.router.metrics.pd_leg(PREFILL, "failed")
            try:
                decision = self.router.prefill_instead(life.key, decision.instance, plan.decode.instance)
            except NoInstanceAvailable:
                break
        return False, None

    async def _side_answer(self, request: web.Request, leg_body: bytes, decision: Decision) -> bytes | None:
        """A leg whose answer the client never sees, read whole: its body, or None if it failed (not 200, no
        answer in time, too long); the failure is counted against the instance as any other."""
        name = decision.instance
        try:
            upstream, chunk = await self._open(request, leg_body, name)
        except _ConnectFailed as exc:
            self.router.metrics.upstream_error(name, "connect")
            self.health.connection_failed(name, str(exc), exc.error.timed_out)
            self.router.unrecord(decision)
            return None
        except _NoAnswer:
            return None
        complete = False
        try:
            self._note_status(name, upstream.status)
            chunks, size = [chunk], len(chunk)
            while chunk and size <= MAX_PREFILL_ANSWER:
                chunk = await upstream.read_chunk(idle_timeout=self.settings.idle_timeout)
                chunks.append(chunk)
                size += len(chunk)
            complete = not chunk
            self.router.metrics.answered(name, upstream.status if complete else 502)
            return b"".join(chunks) if complete and upstream.status == 200 else None
        except (TimeoutError, UpstreamError, OSError):
            self.router.metrics.upstream_error(name, "disconnect")
            return None
        finally:
            if complete:
                upstream.release()
            else:
                upstream.close()

    async def _forward_bootstrap(self, request: web.Request, body: bytes, parsed: dict, life: Lifecycle,
                                 plan: Plan) -> web.StreamResponse:
        """SGLang's split: the two legs at once, paired by a bootstrap room; the decode leg answers."""
        prefill = plan.prefill
        assert prefill is not None
        host = urlsplit(self.urls[prefill.instance]).hostname or ""
        fields = bootstrap_fields(host, self.bootstrap_ports.get(prefill.instance))
        leg = self.router.dispatch(life, prefill, defer_record=True, role=PREFILL)
        side = asyncio.create_task(self._bootstrap_prefill(request, with_fields(parsed, fields), life, leg))
        request[access.PREFILL] = prefill.instance
        try:
            return await self._forward(request, body, life, plan.decode, with_fields(parsed, fields), DECODE,
                                       alongside=True)
        finally:
            if not side.done():
                side.cancel()

    async def _bootstrap_prefill(self, request: web.Request, leg_body: bytes, life: Lifecycle, leg: Leg) -> None:
        answer = await self._side_answer(request, leg_body, leg.decision)
        if not leg.done:  # else closed with the request, or with the decode leg it was sent with
            life.leg_finished(leg, answered=answer is not None)
        self.router.metrics.pd_leg(PREFILL, "ok" if answer is not None else "failed")

    def cancel_forwarding(self) -> int:
        """Cancel every request still being forwarded (the shutdown deadline); returns how many."""
        tasks = list(self._forwarding)
        for task in tasks:
            task.cancel()
        return len(tasks)

    async def _forward(self, request: web.Request, body: bytes, life: Lifecycle, decision: Decision,
                       leg_body: bytes | None = None, role: str = "", alongside: bool = False) -> web.StreamResponse:
        """Send to the decision's instance; if it fails before any byte reached the client, once more to the next
        choice (never the same instance twice in a row) as the `retry` setting allows: connect (no connection
        could be opened), no_answer (also: no first byte within first_byte_timeout, or the connection dropped
        before answering; that connection is closed before the retry, so the engine aborts the request), off.
        A split request's decode leg (`leg_body`, `role`, `alongside`: sent with its prefill leg) that fails so
        is sent once more as the whole request (`body`)."""
        policy = self.settings.retry
        for attempt in (0, 1):
            last = attempt == 1 or policy == "off"
            request[access.DECISION], request[access.ATTEMPTS] = decision, attempt + 1  # for the access log
            leg = self.router.dispatch(life, decision, defer_record=True, role=role, alongside=alongside)
            try:
                held = await self.router.hold_for_prefill(life, leg)  # another request there computes its prefix
                if held:
                    request[access.HELD] = held
                response = await self._exchange(request, body if leg_body is None else leg_body, life)
                if role:
                    self.router.metrics.pd_leg(role, "ok", decision.uncached_tokens)
                return response
            except _ConnectFailed as exc:
                self.router.metrics.upstream_error(decision.instance, "connect")
                self.health.connection_failed(decision.instance, str(exc), exc.error.timed_out)
                self.router.unrecord(decision)
                if last:
                    raise ApiError(502, f"could not connect to instance {decision.instance}", "upstream_error",
                                   instance=decision.instance) from None
                error = None
            except _NoAnswer as exc:  # its connection is closed already (_open)
                if last or policy == "connect":
                    raise exc.error from None
                error = exc.error
            except asyncio.CancelledError:  # the client went away; aiohttp cancels its handler
                self.router.metrics.answered(decision.instance, CLIENT_CLOSED)
                raise
            finally:
                if life.state is State.DISPATCHED:
                    life.retry()  # no first byte: its books there close, and another instance may take it
                    if role:
                        self.router.metrics.pd_leg(role, "failed")
                else:
                    life.finish()
            failed = decision.instance
            leg_body, role, alongside = None, "", False  # tried again whole
            request.pop(access.PREFILL, None)
            try:
                decision = self.router.decide(life.key, avoid=failed)
            except NoInstanceAvailable:
                if error is None:
                    raise
                raise error from None  # nowhere else to go: the first instance's error stands
            self.router.metrics.retried(failed, "connect" if error is None else error.kind)
        raise AssertionError("unreachable")

    async def _exchange(self, request: web.Request, body: bytes, life: Lifecycle) -> web.StreamResponse:
        leg = life.leg
        assert leg is not None
        decision, name = leg.decision, leg.instance
        upstream, first = await self._open(request, body, name)
        completed = False
        try:
            life.first_token()
            request[access.FIRST_BYTE] = time.perf_counter()
            self._note_status(name, upstream.status)
            resp = self._response_for(upstream, decision, request.get(access.WAITED), request.get(access.PREFILL),
                                      request.get(access.HELD))
            await resp.prepare(request)
            readable = upstream.status == 200 and "Content-Encoding" not in upstream.headers
            tap = UsageTap() if readable and is_routed(request.path) else None
            outcome = await self._relay(request, resp, upstream, first, name, tap)
            completed = outcome == upstream.status
            self.router.metrics.answered(name, outcome)
            usage = tap.result() if tap is not None and completed else None
            if usage is not None:
                self.router.engine_usage(life, usage)
            return resp
        finally:
            if completed:
                upstream.release()
            else:
                upstream.close()  # closes the connection: the engine sees the disconnect and stops

    def _note_status(self, name: str, status: int) -> None:
        self.health.upstream_answered(name, status)
        if status >= 500:
            self.router.metrics.upstream_error(name, "status_5xx")
        elif status == 429:
            self.router.metrics.upstream_error(name, "status_429")

    async def _open(self, request: web.Request, body: bytes, name: str) -> tuple[UpstreamResponse, bytes]:
        """Send the request and wait for its first body chunk (or its end), within first_byte_timeout.

        The client gets headers only once the first chunk is here, so a first-byte timeout is a clean 504.
        """
        upstream: UpstreamResponse | None = None
        deadline = asyncio.get_running_loop().time() + self.settings.first_byte_timeout
        try:
            upstream = await self.upstreams.pool.request(self.urls[name], request.method, _target(request),
                                               _filter(request.headers, _NOT_FORWARDED_UP), body, deadline)
            return upstream, await upstream.read_chunk(deadline)
        except ConnectError as exc:
            raise _ConnectFailed(exc) from None
        except TimeoutError:
            self._abandon(upstream)
            self.router.metrics.upstream_error(name, "timeout")
            self.health.failed(name, "first-byte timeout")
            raise _NoAnswer(ApiError(504, f"instance {name} sent nothing within first_byte_timeout "
                                          f"({self.settings.first_byte_timeout:g} s)", "upstream_timeout",
                                     instance=name)) from None
        except (UpstreamError, OSError) as exc:
            self._abandon(upstream)
            self.router.metrics.upstream_error(name, "disconnect")
            self.health.failed(name, f"request failed: {exc}")
            raise _NoAnswer(ApiError(502, f"instance {name} closed the connection before answering",
                                     "upstream_error", instance=name)) from None
        except BaseException:  # cancelled: the client went away
            self._abandon(upstream)
            raise

    @staticmethod
    def _abandon(upstream: UpstreamResponse | None) -> None:
        if upstream is not None:
            upstream.close()

    def _response_for(self, upstream: UpstreamResponse, decision: Decision, waited: float | None = None,
                      prefill: str | None = None, held: float | None = None) -> web.StreamResponse:
        resp = _Relayed(status=upstream.status, reason=upstream.reason,
                                  headers=_filter(upstream.headers, _NOT_FORWARDED_DOWN))
        if upstream.content_length is not None:
            resp.content_length = upstream.content_length  # same bytes, same length
        if self.settings.decision_headers:
            resp.headers["x-warmroute-instance"] = decision.instance
            # How the depth was known ("match=precise"), how long it waited in the router's queue and why, and how long
            # it was held for another request's prefill of its prefix, if it was:
            # "cache_hit; match=precise; queued=0.153s; engine_full; held=0.412s; shared_prefill".
            reason = decision.reason if not decision.match else f"{decision.reason}; match={decision.match}"
            reason = reason if not decision.note else f"{reason}; {decision.note}"
            if waited is not None:
                reason = f"{reason}; queued={waited:.3f}s" + (f"; {decision.waited_for}" if decision.waited_for else "")
            if held is not None:
                reason = f"{reason}; held={held:.3f}s; shared_prefill"
            resp.headers["x-warmroute-reason"] = reason
            # what the router expects the engine to report cached, so a client can measure its prediction
            resp.headers["x-warmroute-predicted-hit"] = f"{decision.matched_ratio:.4f}"
            if prefill is not None:  # a split request's prefill leg went there
                resp.headers[PREFILL_INSTANCE] = prefill
        return resp

    async def _relay(self, request: web.Request, resp: web.StreamResponse, upstream: UpstreamResponse,
                     chunk: bytes, name: str, tap: UsageTap | None) -> int:
        """Write each upstream chunk as it arrives (`tap` looks for the engine's usage report on the way).
        Returns the status to count: the upstream's when the whole answer was delivered, CLIENT_CLOSED if the
        client left, 502 if the upstream failed mid-answer."""
        sink = None
        try:
            while True:
                try:
                    chunk, ended = self._with_ready(upstream, chunk)
                except UpstreamError:
                    self._cut(request, resp, name, "disconnect")
                    return 502
                if tap is not None and chunk:
                    tap.feed(chunk)
                if ended:  # the last bytes and the end of the answer in one write
                    await resp.write_eof(chunk)
                    return upstream.status
                if chunk:
                    await resp.write(chunk)  # the first one also sends the headers
                    sink = sink or _direct_writer(request, resp, tap)
                try:  # what arrives meanwhile goes straight to the client (sink) while it keeps up
                    chunk = await upstream.read_chunk(sink=sink, idle_timeout=self.settings.idle_timeout)
                except (TimeoutError, UpstreamError, OSError) as exc:
                    self._cut(request, resp, name, "timeout" if isinstance(exc, TimeoutError) else "disconnect")
                    return 502
        except ConnectionResetError:  # writing to a client that went away
            return CLIENT_CLOSED

    @staticmethod
    def _with_ready(upstream: UpstreamResponse, chunk: bytes) -> tuple[bytes, bool]:
        """`chunk` and whatever else has already arrived (no wait, no timer), and whether that is the end."""
        while upstream.ready():
            more = upstream.read_nowait()
            if not more:
                return chunk, True
            chunk += more
        return chunk, False

    def _cut(self, request: web.Request, resp: web.StreamResponse, name: str, kind: str) -> None:
        """Headers are out, so the status cannot change: drop the client's connection so it sees a
        truncated response instead of a complete one."""
        self.router.metrics.upstream_error(name, kind)
        log.warning("instance %s: response cut short (%s)", name, kind)
        resp.force_close()
        if request.transport is not None:
            request.transport.close()
