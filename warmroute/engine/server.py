"""The emulated instance's HTTP face, and a fleet of instances in one process.

Routes: POST /v1/chat/completions and /v1/completions (streamed or not), GET /v1/models, /health,
/metrics (vLLM's names), and /get_model_info, /get_server_info (with their newer names /model_info,
/server_info) that SGLang Model Gateway and vllm-router probe at start.

A prompt is what a vLLM server would make of it: the chat template rendered and tokenized with the model's
own tokenizer (`tokenizer.PromptTokenizer`), cut into blocks of token ids hashed as vLLM hashes them
(`kv_hash`). Nothing here shares the router's idea of a prefix: the router has to predict it. A client that
disconnects cancels its sequence in the model.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from warmroute import __version__
from warmroute.engine.driver import EngineDriver, TokenStream
from warmroute.engine.kv_hash import block_hashes
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


class EngineServer:
    """One emulated instance: its model, the driver that runs it in real time, and its routes."""

    def __init__(self, config: EngineConfig, tokenizer: PromptTokenizer, *, name: str = "engine-0",
                 model_name: str = DEFAULT_MODEL, time_scale: float = 1.0,
                 kv_events: KvEventPublisher | None = None) -> None:
        self.name = name
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.kv_events = kv_events  # where it publishes what its cache stores and evicts (vLLM's format)
        self.model = EngineModel(config, kv_events)
        self.driver = EngineDriver(self.model, time_scale)
        self.metrics = EngineMetrics(self.model, model_name, lambda: self.driver.behind_s)
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0: any free port); returns the instance's base URL. OSError if it cannot."""
        runner = web.AppRunner(self._app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        if self.kv_events is not None:
            await self.kv_events.start()
        self.driver.start()
        bound = runner.addresses[0][1]
        self.url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        return self.url

    async def close(self) -> None:
        await self.driver.close()  # in-flight requests end now, so the runner need not wait for them
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
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
            limit = self.model.config.kv_capacity_tokens  # a longer prompt is refused before it is tokenized
            ids = (self.tokenizer.chat_ids(body, limit) if chat
                   else self.tokenizer.completion_ids(body.get("prompt"), limit))
            hashes = block_hashes(ids, self.model.config.block_size, cache_salt=_cache_salt(body))
            tokens = self.driver.submit(hashes, len(ids), max_tokens, every_token=streaming, token_ids=ids)
        except ValueError as exc:
            return _error(400, str(exc))
        reply = Completion(chat, self.model_name, len(ids))
        try:
            if streaming:
                return await _stream(request, tokens, reply)
            while not tokens.finished:
                if tokens.failed:
                    return _error(503, "the engine stopped", "server_error")
                await tokens.changed()
            return web.json_response(reply.response(tokens.generated, tokens.cached_tokens))
        finally:
            self.driver.cancel(tokens)  # the client left (handler cancelled) or it finished: a no-op then

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
            "internal_states": [{"last_gen_throughput": 0.0}],
        })

    def _model_fields(self) -> dict[str, Any]:
        return {"model_path": self.model_name, "served_model_name": self.model_name,
                "tokenizer_path": str(self.tokenizer.directory),
                "is_generation": True, "preferred_sampling_params": None, "emulated": True}


async def _stream(request: web.Request, tokens: TokenStream, reply: Completion) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    sent = 0
    try:
        while True:
            if tokens.generated > sent:
                await response.write(reply.token_chunks(sent, tokens.generated))
                sent = tokens.generated
            if tokens.finished:
                await response.write(reply.closing_chunks(sent, tokens.cached_tokens))
                break
            if tokens.failed:
                await response.write(sse(error_body("the engine stopped", "server_error", 503)))
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
                      kv_events_port: int | None = None, kv_events_replay: bool = True) -> Fleet:
    """Start `count` instances on base_port..base_port+count-1 (0: free ports), named engine-0.. (or NAME-i;
    just NAME when count is 1). `config` defaults to the 8b profile, `tokenizer` to the tiny model's (shared
    by the instances). `kv_events_port`: instance i publishes its KV-cache events on host at that port + 2i
    (0: a free port) and answers replays at the next one (unless not `kv_events_replay`). OSError if a port
    cannot be bound."""
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
                                  kv_events=events)
            await server.start(host, base_port + i if base_port else 0)
            fleet.servers.append(server)
    except BaseException:
        await fleet.close()
        raise
    return fleet


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
