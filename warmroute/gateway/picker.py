"""The endpoint picker: Envoy's ext_proc protocol, one gRPC stream per HTTP request through the gateway.

Per stream (Gateway API Inference Extension, EPP protocol v1.0.0):
  request headers   the path, the session header, the length; a request without a body is decided here
  request body      BUFFERED: one message; FULL_DUPLEX_STREAMED: chunks until end_of_stream, echoed back
                    once decided (not STREAMED: Envoy routes on the headers before a body of several chunks ends). The routing key and the decision come from the same Router as `serve`
                    (router/routing.py); the answer sets the request header x-gateway-destination-endpoint to
                    `ip:port` (then `epp_fallbacks` others, comma-separated) and the same value in dynamic
                    metadata `envoy.lb`. A subset hint (`envoy.lb.subset_hint` /
                    x-gateway-destination-endpoint-subset) limits the choice; a bad body gets serve's 400 and no
                    instance serve's 503, as immediate responses.
  response headers  which endpoint served (`envoy.lb` / x-gateway-destination-endpoint-served, where the gateway
                    fell back past the chosen one: the books move there), the status, the decision headers;
                    where the body cannot correct the index (no engine feedback, an error, a strategy without a
                    prefix index) a `mode_override` stops Envoy sending it (allow_mode_override in deploy/envoy/)
  response body     the first chunk is the first token; the usage with cached_tokens is read on the way
                    (router/usage.py) for the index's feedback
The request's books close when its response ends, and in any case when the stream ends or breaks (a client that
leaves, a gateway that resets the stream): nothing stays counted in flight.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping

import grpc
from multidict import CIMultiDict, CIMultiDictProxy
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as modes
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from warmroute.core.lifecycle import ENDED, Lifecycle, OutOfOrder, State
from warmroute.core.routing_key import ROUTED_PATHS, RoutingKey
from warmroute.core.strategies import UNHEALTHY_FALLBACK, Decision, ModelNotServed, NoInstanceAvailable
from warmroute.gateway.endpoints import endpoint_of, names_at
from warmroute.router.app import FORWARDED_PATHS, unknown_path
from warmroute.router.dashboard import Activity
from warmroute.router.errors import ApiError, error_body, no_instance, too_large
from warmroute.router.health import Health
from warmroute.router.metrics import NO_INSTANCE
from warmroute.router.proxy import CLIENT_CLOSED
from warmroute.router.routing import SESSION_HEADER, Router, is_routed
from warmroute.router.settings import RouterSettings
from warmroute.router.tenancy import Tenancy
from warmroute.router.usage import UsageTap

log = logging.getLogger("warmroute.gateway")

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
ATTRIBUTES, CODE_DETAILS = "envoy.filters.http.ext_proc", "response.code_details"
SERVICE_NAME = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name

# What serve forwards, plus the model list, which serve answers itself (merged) and a gateway can only pass on.
GATEWAY_FORWARDED = FORWARDED_PATHS | {"/v1/models"}

_Mode = modes.ProcessingMode
_OVERWRITE = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_CONTINUE_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
_CONTINUE_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse())
_CONTINUE_RESPONSE_BODY = ep.ProcessingResponse(response_body=ep.BodyResponse())
# Where Envoy allows it (allow_mode_override), a response whose body teaches nothing is not sent to the picker;
# not from FULL_DUPLEX_STREAMED, whose mode Envoy does not let a processor change.
_SKIPPABLE = (_Mode.STREAMED, _Mode.BUFFERED)
_NO_RESPONSE_BODY = _Mode(response_body_mode=_Mode.NONE)


def _header(key: str, value: str) -> core.HeaderValueOption:
    return core.HeaderValueOption(header=core.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def _headers(message: ep.HttpHeaders) -> Mapping[str, str]:
    return {h.key: (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
            for h in message.headers.headers}


def immediate(exc: ApiError) -> ep.ProcessingResponse:
    """serve's error answer (status, JSON body, headers) as the gateway's immediate response."""
    headers = [_header("content-type", "application/json")] + [_header(k.lower(), v) for k, v in exc.headers.items()]
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=exc.status), headers=ep.HeaderMutation(set_headers=headers),
        body=error_body(exc.status, exc.message, exc.kind).encode(), details=f"warmroute_{exc.kind}"))


def _subset(metadata: core.Metadata) -> list[str] | None:
    """The endpoints the gateway allows for this request (a list or a comma-separated string); None: any."""
    hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    return [e for e in value.string_value.split(",") if e.strip()]


def _served(metadata: core.Metadata) -> str | None:
    lb = metadata.filter_metadata.get(LB_NAMESPACE)
    if lb is None or SERVED not in lb.fields:
        return None
    return lb.fields[SERVED].string_value or None


def _connect_failed(message: ep.ProcessingRequest) -> bool:
    """Whether Envoy's own 503 says the connection to the instance failed (ext_proc's `response_attributes`
    include response.code_details in deploy/envoy/)."""
    attributes = message.attributes.get(ATTRIBUTES)
    if attributes is None or CODE_DETAILS not in attributes.fields:
        return False
    details = attributes.fields[CODE_DETAILS].string_value
    return details.startswith("upstream_reset_before_response_started") and "connection_failure" in details


class Picker(ep_grpc.ExternalProcessorServicer):
    """The ext_proc service: one `Exchange` per stream, all sharing the router's books."""

    def __init__(self, router: Router, health: Health, urls: Mapping[str, str], settings: RouterSettings,
                 activity: Activity | None = None, tenancy: Tenancy | None = None) -> None:
        self.router = router
        self.tenancy = tenancy if tenancy is not None else Tenancy(settings)
        self.health = health
        self.urls = urls  # instance name -> base URL (discovery keeps it current)
        self.settings = settings
        self.activity = activity
        self.streams = 0  # open streams (tests, shutdown)

    async def Process(self, requests: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext) -> None:
        # context.read / write rather than an async generator: a quarter less CPU per message in grpc.aio
        exchange = Exchange(self)
        self.streams += 1
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                for reply in await exchange.on(message):
                    await context.write(reply)
        finally:  # the stream ended, or broke (the gateway reset it, the client left): the books close
            self.streams -= 1
            exchange.close()


class Exchange:
    """One HTTP request through the gateway, message by message; its books are its `Lifecycle`'s, so a message
    out of order is refused and never opens a second set."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.path = "/"
        self.session: str | None = None
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.request_mode = _Mode.BUFFERED
        self.response_mode = _Mode.NONE
        self.body_skipped = False  # the picker asked Envoy not to send the response body (mode_override)
        self.subset: list[str] | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.choices: list[Decision] = []  # the chosen instance, then its fallbacks, in the gateway's order
        self.life: Lifecycle = picker.router.open()
        self.tap: UsageTap | None = None
        self.status = 0

    @property
    def decision(self) -> Decision | None:
        """The decision of the instance serving it (its open leg), if any."""
        leg = self.life.leg
        return leg.decision if leg is not None and not leg.done else None

    async def on(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind in ("request_headers", "request_body") and self.life.state is not State.RECEIVED:
            # One request per stream: a second request's headers, or a body after the decision, close this one's
            # books and are refused (never a second decision, whose books would stay open).
            return self._out_of_order(kind, "after this stream's request was decided")
        try:
            return await self._on(kind, message)
        except OutOfOrder as exc:  # a response message the request's state does not allow
            return self._out_of_order(kind, str(exc))

    def _out_of_order(self, kind: str | None, why: str) -> list[ep.ProcessingResponse]:
        if self.life.state in ENDED:
            return []
        self.close()
        return [self._refuse(ApiError(400, f"ext_proc {kind} {why}", "invalid_request_error"))]

    async def _on(self, kind: str | None, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if kind == "request_headers":
            return await self._request_headers(message)
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "request_trailers":  # a body that ended with trailers: decided now if not yet
            replies = [] if self.life.state is not State.RECEIVED else await self._decide(body_end=True)
            return replies + [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            return [self._response_headers(message)]
        if kind == "response_body":
            return [self._response_body(message.response_body)]
        if kind == "response_trailers":
            self._complete()
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return []

    # -- the request -----------------------------------------------------------------------------------------
    async def _request_headers(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if message.HasField("protocol_config"):
            self.request_mode = message.protocol_config.request_body_mode
            self.response_mode = message.protocol_config.response_body_mode
        self.subset = _subset(message.metadata_context)
        headers = _headers(message.request_headers)
        self.headers = CIMultiDictProxy(CIMultiDict(headers))  # the tenant's and priority's, read as serve reads them
        self.path = headers.get(":path", "/").partition("?")[0]
        if self.path not in ROUTED_PATHS and self.path not in GATEWAY_FORWARDED:
            return [self._refuse(unknown_path())]  # as serve: an engine's control endpoints are never reached
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            return [self._refuse(ApiError(415, f"unsupported Content-Encoding {encoding[:40]!r}: the picker reads "
                                               "bodies as sent; decompress them in the gateway (Envoy's "
                                               "decompressor filter) before ext_proc", "invalid_request_error"))]
        self.session = headers.get(SESSION_HEADER)
        limit = self.picker.settings.max_body_bytes
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            return [self._refuse(too_large(limit))]
        if message.request_headers.end_of_stream:  # no body (GET /v1/models, ...): decided now
            return await self._decide(body_end=False)
        if self.request_mode == _Mode.FULL_DUPLEX_STREAMED:
            return []  # the headers' answer carries the decision, so it waits for the body
        return [_CONTINUE_HEADERS]

    async def _request_body(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if body.body:
            self.chunks.append(body.body)
            self.size += len(body.body)
        limit = self.picker.settings.max_body_bytes
        if self.size > limit:
            return [self._refuse(too_large(limit))]
        if body.end_of_stream or self.request_mode == _Mode.BUFFERED:  # BUFFERED: the whole body in one message
            return await self._decide(body_end=True)
        return [] if self.request_mode == _Mode.FULL_DUPLEX_STREAMED else [_CONTINUE_BODY]

    async def _decide(self, body_end: bool) -> list[ep.ProcessingResponse]:
        picker = self.picker
        router = picker.router
        body = b"".join(self.chunks)
        try:
            key, decision = self._route(body, await router.key_off_loop(self.path, body, self.session))
            self.life.keyed(key, *picker.tenancy.who(self.headers, key))
            # no room at its instance: it waits in the router's queue as serve's requests do (429 past it); not with
            # a subset, which the queue does not know
            queue = self.subset is None and self.path != "/v1/models"
            decision, _ = await router.admit(self.life, decision, len(body), queue)
        except ApiError as exc:
            return [self._refuse(exc)]
        except NoInstanceAvailable as exc:
            model = exc.model if isinstance(exc, ModelNotServed) else None
            return [self._refuse(no_instance(picker.settings.health_interval, model))]
        self.choices = [decision, *self._fallbacks(key, decision)]
        self._dispatch(decision)
        if picker.activity is not None:
            picker.activity.note(key, decision)
        value = ",".join(endpoint_of(picker.urls[d.instance]) for d in self.choices)
        common = ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=[_header(DESTINATION, value)]),
                                   clear_route_cache=True)
        metadata = struct_pb2.Struct(fields={LB_NAMESPACE: struct_pb2.Value(struct_value=struct_pb2.Struct(
            fields={DESTINATION: struct_pb2.Value(string_value=value)}))})
        if not body_end:
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                          dynamic_metadata=metadata)]
        if self.request_mode != _Mode.FULL_DUPLEX_STREAMED:
            return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)]
        echo = ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=True))
        return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata),
                ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=echo)))]

    def _route(self, body: bytes, key: RoutingKey | None) -> tuple[RoutingKey | None, Decision]:
        """serve's decision (`key`: a large body's, built off the loop by Router.key_off_loop)."""
        picker = self.picker
        if self.subset is None:
            return picker.router.route(self.path, body, self.session, key)
        return picker.router.route(self.path, body, self.session, key, within=names_at(picker.urls, self.subset))

    def _fallbacks(self, key: RoutingKey | None, decision: Decision) -> list[Decision]:
        """The least loaded other instances that may serve it (and are in the subset): the gateway tries them in
        order when the chosen one fails. Plain choices, so asking for them changes no strategy's state."""
        count = self.picker.settings.epp_fallbacks
        if not count:
            return []
        fleet = self.picker.router.fleet
        allowed = names_at(self.picker.urls, self.subset) if self.subset is not None else None
        others = [i for i in fleet.routable(key.model if key else None)
                  if i.name != decision.instance and (allowed is None or i.name in allowed)]
        others.sort(key=lambda i: (i.inflight, i.queued_prefill_tokens, i.name))
        return [Decision(i.name, UNHEALTHY_FALLBACK, 0, decision.prompt_tokens, decision.blocks)
                for i in others[:count]]

    def _dispatch(self, decision: Decision) -> None:
        self.picker.router.dispatch(self.life, decision, defer_record=True)

    def _refuse(self, exc: ApiError) -> ep.ProcessingResponse:
        if self.life.state not in ENDED:
            self.life.refuse()
        self.picker.router.metrics.answered(NO_INSTANCE, exc.status)
        return immediate(exc)

    # -- the response ----------------------------------------------------------------------------------------
    def _response_headers(self, message: ep.ProcessingRequest) -> ep.ProcessingResponse:
        served = _served(message.metadata_context)
        if served is not None and self.choices:
            self._served_at(served)
        headers = _headers(message.response_headers)
        status = headers.get(":status", "0")
        self.status = int(status) if status.isdigit() else 0
        decision, picker = self.decision, self.picker
        if decision is None:
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
        if _connect_failed(message):  # Envoy answered for the instance: it refused the connection
            picker.router.metrics.upstream_error(decision.instance, "connect")
            picker.health.connection_failed(decision.instance)  # ejected at once, as serve does
            picker.router.unrecord(decision)
        else:
            picker.health.upstream_answered(decision.instance, self.status)
        if self.status == 200 and "content-encoding" not in headers and is_routed(self.path):
            self.tap = UsageTap()
        override = None
        if self.response_mode in _SKIPPABLE and not self._usage_wanted(decision):
            override = _NO_RESPONSE_BODY  # nothing to learn from it: Envoy stops sending its chunks (fewer messages)
            self.body_skipped = True
        if message.response_headers.end_of_stream or self.response_mode == _Mode.NONE or self.body_skipped:
            self.life.first_token()  # nothing more will be seen of it: its first byte is now
        if message.response_headers.end_of_stream:
            self._complete()
        mutation = None
        if picker.settings.decision_headers:
            mutation = ep.HeaderMutation(set_headers=[
                _header("x-warmroute-instance", decision.instance), _header("x-warmroute-reason", decision.reason),
                _header("x-warmroute-predicted-hit", f"{decision.matched_ratio:.4f}")])
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=mutation)), mode_override=override)

    def _usage_wanted(self, decision: Decision) -> bool:
        """Whether the response body can correct the index: engine feedback on, a body whose usage is read, a
        strategy that records prefixes and a decision that predicted blocks."""
        router = self.picker.router
        return (self.tap is not None and self.picker.settings.engine_feedback and router.strategy.records_prefixes
                and bool(decision.blocks))

    def _served_at(self, served: str) -> None:
        """The gateway fell back past the chosen instance (it refused or dropped the connection): the instances
        before the one that served count as failed connections, as in serve, and the books move to it."""
        picker = self.picker
        urls = picker.urls
        names = [d.instance for d in self.choices]
        at = next((k for k, d in enumerate(self.choices)
                   if d.instance in urls and endpoint_of(urls[d.instance]) == served), None)
        if at == 0:
            return
        sent = self.life.retry().decision  # it never reached the first instance (a later message: OutOfOrder)
        for name in names if at is None else names[:at]:
            picker.router.metrics.upstream_error(name, "connect")
            picker.health.connection_failed(name)
        picker.router.unrecord(sent)
        if at is not None:
            picker.router.metrics.retried(names[0], "connect")
            self._dispatch(self.choices[at])
            return
        elsewhere = sorted(names_at(urls, [served]))  # served by an instance the picker did not name (FailOpen)
        if elsewhere:
            self._dispatch(Decision(elsewhere[0], UNHEALTHY_FALLBACK, 0, sent.prompt_tokens))

    def _response_body(self, body: ep.HttpBody) -> ep.ProcessingResponse:
        self.body_skipped = False  # sent after all (the gateway does not allow mode_override): read to its end
        if self.decision is not None:
            if self.life.state is State.DISPATCHED:
                self.life.first_token()
            if self.tap is not None and body.body:
                self.tap.feed(body.body)
            if body.end_of_stream:
                self._complete()
        if self.response_mode != _Mode.FULL_DUPLEX_STREAMED:
            return _CONTINUE_RESPONSE_BODY
        echo = ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=body.body,
                                                                         end_of_stream=body.end_of_stream))
        return ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=echo)))

    def _complete(self) -> None:
        """The whole answer went through: counted, its usage read, its books closed."""
        decision = self.decision
        if decision is None:
            return
        router = self.picker.router
        router.metrics.answered(decision.instance, self.status)
        usage = self.tap.result() if self.tap is not None else None
        if usage is not None and self.life.state is State.FIRST_TOKEN:
            router.engine_usage(self.life, usage)
        self.life.finish()

    def close(self) -> None:
        """The stream is over: an answer not seen to its end was cut off (or its body was not sent to the picker);
        whatever else is open closes."""
        decision = self.decision
        if decision is None or self.life.state in ENDED:
            self.life.close()
            return
        if self.status and (self.response_mode == _Mode.NONE or self.body_skipped):
            self._complete()
            return
        self.picker.router.metrics.answered(decision.instance, CLIENT_CLOSED)
        self.life.finish()
