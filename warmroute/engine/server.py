"""The emulated instance's HTTP face, and a fleet of instances in one process.

Routes: POST /v1/chat/completions and /v1/completions (streamed or not), GET /v1/models, /health,
/metrics (vLLM's names), and /get_model_info, /get_server_info (with their newer names /model_info,
/server_info) that SGLang Model Gateway and vllm-router probe at start. With a KV transfer (`kv_transfer`:
vLLM's NixlConnector or SGLang's bootstrap), requests may be legs of disaggregated prefill/decode and the
instance serves its side channel, POST /kv_transfer/{read,done,heartbeat} (see kv_transfer.py).

A prompt is what a vLLM server would make of it: the chat template rendered and tokenized with the model's
own tokenizer (`tokenizer.PromptTokenizer`), cut into blocks of token ids hashed as vLLM hashes them
(`kv_hash`). Nothing here shares the router's idea of a prefix: the router has to predict it. A client that
disconnects cancels its sequence in the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from warmroute import __version__
from warmroute.engine.driver import EngineDriver, TokenStream
from warmroute.engine.kv_hash import block_hashes
from warmroute.engine.kv_transfer import KvTransfer, Leg, TransferConfig, TransferFailed
from warmroute.engine.metrics import EngineMetrics
from warmroute.engine.model import EngineConfig, EngineModel
from warmroute.engine.openai_format import Completion, error_body, request_options, sse
from warmroute.engine.tokenizer import PromptTokenizer, load_tokenizer

if TYPE_CHECKING:
    from warmroute.engine.kv_events import KvEventPublisher

DEFAULT_MODEL = "warmroute-emulated"
CHAT_PATH = "/v1/chat/completions"
MAX_BODY_BYTES = 64 * 1024 * 1024  # long-context prompts are large
SHUTDOWN_TIMEOUT_S = 2.0

Settle = Callable[[], Awaitable[None]]  # a leg's part once its tokens are out (TransferFailed if its KV was lost)


class EngineServer:
    """One emulated instance: its model, the driver that runs it in real time, and its routes."""

    def __init__(self, config: EngineConfig, tokenizer: PromptTokenizer, *, name: str = "engine-0",
                 model_name: str = DEFAULT_MODEL, time_scale: float = 1.0,
                 kv_events: KvEventPublisher | None = None, kv_transfer: TransferConfig | None = None) -> None:
        self.name = name
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.kv_events = kv_events  # where it publishes what its cache stores and evicts (vLLM's format)
        self.model = EngineModel(config, kv_events)
        self.driver = EngineDriver(self.model, time_scale)
        self.kv_transfer = None if kv_transfer is None else KvTransfer(kv_transfer, self.driver, config.block_size)
        self.metrics = EngineMetrics(self.model, model_name, lambda: self.driver.behind_s, self.kv_transfer)
        self.url = ""
        self.bootstrap_port = 0  # where SGLang's decode instances reach this one's side channel
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0, bootstrap_port: int | None = None) -> str:
        """Listen on host:port (0: any free port), and also on bootstrap_port if given (SGLang's bootstrap port: the
        side channel, there as on the main port); returns the instance's base URL. OSError if it cannot."""
        runner = web.AppRunner(self._app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            if bootstrap_port is not None:
                await web.TCPSite(runner, host, bootstrap_port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        if self.kv_events is not None:
            await self.kv_events.start()
        self.driver.start()
        bound = runner.addresses[0][1]
        self.bootstrap_port = runner.addresses[1][1] if bootstrap_port is not None else bound
        if self.kv_transfer is not None:
            self.kv_transfer.bind(host, bound)
        self.url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        return self.url

    async def close(self) -> None:
        await self.driver.close()  # in-flight requests end now, so the runner need not wait for them
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.kv_transfer is not None:
            await self.kv_transfer.close()
        if self.kv_events is not None:
            await self.kv_events.close()

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(CHAT_PATH, self._completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, self._model_info)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, self._server_info)
        app.router.add_get("/kv_event_sources", self._kv_event_sources)
        if self.kv_transfer is not None:
            self.kv_transfer.add_routes(app)
        return app

    # -- completions -------------------------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        chat = request.path == CHAT_PATH
        try:
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            max_tokens, streaming = request_options(body)
            leg = self.kv_transfer.leg(body) if self.kv_transfer is not None else None
            if leg is not None and leg.prefill and not self.kv_transfer.nixl:
                max_tokens = 1  # an SGLang prefill instance computes the first token only
            limit = self.model.config.kv_capacity_tokens  # a longer prompt is refused before it is tokenized
            ids = (self.tokenizer.chat_ids(body, limit) if chat
                   else self.tokenizer.completion_ids(body.get("prompt"), limit))
            hashes = block_hashes(ids, self.model.config.block_size, cache_salt=_cache_salt(body))
            tokens = self.driver.submit(hashes, len(ids), max_tokens, every_token=streaming, token_ids=ids,
                                        **self._leg_options(leg))
        except ValueError as exc:
            return _error(400, str(exc))
        reply = Completion(chat, self.model_name, len(ids))
        pull = self.kv_transfer.start(leg, tokens, hashes, len(ids)) if leg is not None else None
        extra: dict[str, Any] = {}  # the leg's response fields, once it has settled

        async def settle() -> None:
            extra.update(await self._settle(leg, tokens, reply, hashes))

        try:
            if streaming:
                return await _stream(request, tokens, reply, settle)
            return await _whole(tokens, reply, settle, extra)
        finally:
            self.driver.cancel(tokens)  # the client left (handler cancelled) or it finished: a no-op then
            if pull is not None:
                pull.cancel()
            if leg is not None and leg.prefill and not extra.get("kv_transfer_params"):
                self.driver.release(tokens)  # nobody will read a prefill's blocks that no response named

    def _leg_options(self, leg: Leg | None) -> dict[str, bool]:
        """How the model runs a leg: a decode leg loads its KV (SGLang's without the prefix cache), a prefill leg
        keeps it."""
        if leg is None or self.kv_transfer is None:
            return {}
        return {"remote": leg.decode, "hold": leg.prefill, "cache": self.kv_transfer.nixl or leg.prefill}

    async def _settle(self, leg: Leg | None, tokens: TokenStream, reply: Completion,
                      hashes: Sequence[bytes]) -> dict[str, Any]:
        kvt = self.kv_transfer
        if kvt is None:
            return {}
        if leg is None:
            return {"kv_transfer_params": None} if kvt.nixl else {}  # vLLM with a connector always says
        return await kvt.settle(leg, tokens, reply.request_id, hashes, reply.prompt_tokens)

    # -- informational routes --------------------------------------------------------------------------------
    async def _models(self, _: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "warmroute",
                "root": self.model_name, "parent": None, "max_model_len": self.model.config.kv_capacity_tokens}
        return web.json_response({"object": "list", "data": [card]})

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    async def _kv_event_sources(self, _: web.Request) -> web.Response:
        """Where it publishes its KV-cache events, per data-parallel rank, in the shape of vLLM's answer."""
        pub = self.kv_events
        if pub is None:
            return web.json_response({})
        return web.json_response({"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                                        "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                                        "buffer_steps": pub.buffer.maxlen, "topic": pub.topic.decode()}})

    async def _model_info(self, _: web.Request) -> web.Response:
        return web.json_response(self._model_fields())

    async def _server_info(self, _: web.Request) -> web.Response:
        cfg = self.model.config
        return web.json_response({
            **self._model_fields(), "name": self.name, "version": f"warmroute-{__version__}",
            "tp_size": 1, "dp_size": 1, "page_size": cfg.block_size,
            "max_total_num_tokens": cfg.kv_capacity_tokens, "max_running_requests": cfg.max_running,
            "chunked_prefill_size": cfg.max_batched_tokens, "time_scale": self.driver.time_scale,
            "internal_states": [{"last_gen_throughput": 0.0}], "disaggregation_mode": "null",
            **(self.kv_transfer.server_info() if self.kv_transfer is not None else {}),
            "disaggregation_bootstrap_port": self.bootstrap_port,
        })

    def _model_fields(self) -> dict[str, Any]:
        return {"model_path": self.model_name, "served_model_name": self.model_name,
                "tokenizer_path": str(self.tokenizer.directory),
                "is_generation": True, "preferred_sampling_params": None, "emulated": True}


async def _whole(tokens: TokenStream, reply: Completion, settle: Settle, extra: dict[str, Any]) -> web.Response:
    while not tokens.finished:
        if tokens.failed:
            return _failed(tokens)
        await tokens.changed()
    try:
        await settle()
    except TransferFailed as exc:
        return _error(500, str(exc), "InternalServerError")
    return web.json_response({**reply.response(tokens.generated, tokens.cached_tokens), **extra})


async def _stream(request: web.Request, tokens: TokenStream, reply: Completion,
                  settle: Settle) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    sent = 0
    try:
        while True:
            if tokens.generated > sent:
                await response.write(reply.token_chunks(sent, tokens.generated))
                sent = tokens.generated
            if tokens.finished:
                try:
                    await settle()
                except TransferFailed as exc:
                    await response.write(sse(error_body(str(exc), "InternalServerError", 500)))
                    break
                await response.write(reply.closing_chunks(sent, tokens.cached_tokens))
                break
            if tokens.failed:
                await response.write(sse(_failure_body(tokens)))
                break
            await tokens.changed()
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; the caller cancels the sequence
    return response


def _cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's per-request `cache_salt`: prompts with different salts never share cached blocks."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("'cache_salt' must be a non-empty string")
    return salt


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response(error_body(message, kind, status), status=status)


def _failure_body(tokens: TokenStream) -> dict[str, Any]:
    """Why a request stopped short: its KV never came (vLLM's 500), or the engine stopped."""
    if tokens.error is not None:
        return error_body(tokens.error, "InternalServerError", 500)
    return error_body("the engine stopped", "server_error", 503)


def _failed(tokens: TokenStream) -> web.Response:
    body = _failure_body(tokens)
    return web.json_response(body, status=body["error"]["code"])


# -- a fleet in one process -------------------------------------------------------------------------------------
@dataclass
class Fleet:
    servers: list[EngineServer]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.servers))


async def start_fleet(count: int = 1, base_port: int = 0, *, host: str = "127.0.0.1",
                      config: EngineConfig | None = None, tokenizer: PromptTokenizer | None = None,
                      name: str | None = None, model_name: str = DEFAULT_MODEL, time_scale: float = 1.0,
                      kv_events_port: int | None = None, kv_events_replay: bool = True,
                      kv_transfer: TransferConfig | None = None, bootstrap_port: int | None = None) -> Fleet:
    """Start `count` instances on base_port..base_port+count-1 (0: free ports), named engine-0.. (or NAME-i;
    just NAME when count is 1). `config` defaults to the 8b profile, `tokenizer` to the tiny model's (shared
    by the instances). `kv_events_port`: instance i publishes its KV-cache events on host at that port + 2i
    (0: a free port) and answers replays at the next one (unless not `kv_events_replay`). `kv_transfer`: the
    instances take legs of disaggregated prefill/decode; `bootstrap_port`: instance i also serves its side
    channel at that port + i (0: a free port). OSError if a port cannot be bound."""
    config = config or EngineConfig.from_profile()
    tokenizer = tokenizer or load_tokenizer()
    fleet = Fleet([])
    try:
        for i in range(count):
            label = name if name and count == 1 else f"{name or 'engine'}-{i}"
            events = None
            if kv_events_port is not None:
                from warmroute.engine.kv_events import KvEventPublisher  # pyzmq and msgspec: only when asked

                port = kv_events_port + 2 * i if kv_events_port else 0
                events = KvEventPublisher(_tcp(host, port), replay_endpoint=_tcp(host, port + 1 if port else 0)
                                          if kv_events_replay else None, bind=True)
            server = EngineServer(config, tokenizer, name=label, model_name=model_name, time_scale=time_scale,
                                  kv_events=events, kv_transfer=kv_transfer)
            side = None if bootstrap_port is None else bootstrap_port + i if bootstrap_port else 0
            await server.start(host, base_port + i if base_port else 0, side)
            fleet.servers.append(server)
    except BaseException:
        await fleet.close()
        raise
    return fleet


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
