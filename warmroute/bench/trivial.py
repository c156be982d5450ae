"""Trivial OpenAI-compatible instances for measuring a router itself: canned answers, almost no work.

    python -m warmroute.bench.trivial --count 4 --port 9000 [--itl-ms 20]

The emulated engine (`warmroute engine --time-scale 0`) answers instantly in emulated time, but each
request still costs it about a quarter of a millisecond of Python (routing key, model step, driver), so
on a small machine it saturates before a fast router does. These instances do only what an HTTP answer
needs: a plain asyncio protocol on uvloop reads the request, parses its JSON for `stream` and
`max_tokens`, and writes a prebuilt answer in the emulated engine's format (`openai_format.Completion`:
one SSE event per token, a finish event, the usage event when asked, `[DONE]`).

  * Non-streaming answers go out in one write (Content-Length).
  * Streams are chunked, one HTTP chunk per SSE event. With `itl_ms` 0 the whole stream goes out in one
    write; with `itl_ms` > 0 the first token is written at once and each further token `itl_ms` later
    (a paced stream, like a decoding engine; the time to first token is only the request's handling).
  * Usage reports prompt and completion tokens but no `prompt_tokens_details` (vLLM's default): a router
    gets no cached-token feedback from these instances, so its index is not corrected against answers
    that know nothing of caching.
  * GET /v1/models, /health, /metrics, /get_model_info, /get_server_info (and /model_info, /server_info,
    which SGLang Model Gateway probes) answer with small fixed bodies; anything else is a 404.

HTTP/1.1 keep-alive, requests parsed by httptools and answered in order, one at a time (no Expect:
100-continue): enough for routers and load generators, not a general server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httptools

from warmroute.engine.openai_format import Completion, error_body
from warmroute.engine.server import DEFAULT_MODEL

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Payload Too Large"}


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def response_head(status: int, content_type: str, length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    extra = "Cache-Control: no-cache\r\n" if content_type == "text/event-stream" else ""
    return (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {content_type}\r\n{extra}"
            f"{framing}\r\n\r\n").encode()


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


@dataclass
class Answers:
    """Prebuilt answer bytes per (chat?, stream?, max_tokens, usage in stream?)."""

    model: str = DEFAULT_MODEL
    prompt_tokens: int = 100  # reported in usage (a fixed figure: these instances do not tokenize)
    _cache: dict[tuple[bool, bool, int, bool], Any] = field(default_factory=dict)

    def plain(self, chat: bool, max_tokens: int) -> bytes:
        key = (chat, False, max_tokens, False)
        got = self._cache.get(key)
        if got is None:
            body = self._completion(chat).response(max_tokens, 0)
            del body["usage"]["prompt_tokens_details"]
            data = _json(body)
            got = self._cache[key] = response_head(200, "application/json", len(data)) + data
        return got

    def stream(self, chat: bool, max_tokens: int, usage: bool) -> tuple[bytes, ...]:
        """The stream as HTTP chunks: [head + first token, token 2, ..., last token + closing + end]."""
        key = (chat, True, max_tokens, usage)
        got = self._cache.get(key)
        if got is None:
            reply = self._completion(chat)
            tokens = [http_chunk(reply.token_chunks(i, i + 1)) for i in range(max_tokens)]
            closing = reply.closing_chunks(max_tokens, 0)
            events = [e + b"\n\n" for e in closing.split(b"\n\n") if e]  # finish, usage, [DONE]
            if not usage:
                events = [e for e in events if b'"usage"' not in e]
            else:
                events = [e.replace(b',"prompt_tokens_details":{"cached_tokens":0}', b"") for e in events]
            tail = b"".join(http_chunk(e) for e in events) + LAST_CHUNK
            tokens[0] = response_head(200, "text/event-stream", None) + tokens[0]
            tokens[-1] += tail
            got = self._cache[key] = tuple(tokens)
        return got

    def _completion(self, chat: bool) -> Completion:
        return Completion(chat, self.model, self.prompt_tokens, id="trivial")

    def info(self, path: str, name: str) -> bytes | None:
        """Fixed bodies of the GET routes; None for an unknown path."""
        fields = {"model_path": self.model, "served_model_name": self.model, "tokenizer_path": None,
                  "is_generation": True, "preferred_sampling_params": None, "emulated": True}
        if path == "/v1/models":
            body: Any = {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                     "owned_by": "warmroute", "root": self.model, "parent": None,
                                                     "max_model_len": 1 << 20}]}
        elif path in ("/get_model_info", "/model_info"):
            body = fields
        elif path in ("/get_server_info", "/server_info"):
            body = {**fields, "name": name, "version": "warmroute-trivial", "tp_size": 1, "dp_size": 1,
                    "page_size": 16, "max_total_num_tokens": 1 << 20, "max_running_requests": 1 << 10,
                    "internal_states": [{"last_gen_throughput": 0.0}]}
        elif path == "/health":
            return response_head(200, "text/plain", 0)
        elif path == "/metrics":
            text = b"# trivial instance: no metrics\n"
            return response_head(200, "text/plain; version=0.0.4", len(text)) + text
        else:
            return None
        data = _json(body)
        return response_head(200, "application/json", len(data)) + data


def _error(status: int, message: str) -> bytes:
    data = _json(error_body(message, code=status))
    return response_head(status, "application/json", len(data)) + data


class _Refused(Exception):
    """Raised from a parser callback: the request is refused with this status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed by httptools, answered in order, one at a time."""

    def __init__(self, server: TrivialServer) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.head_bytes = 0
        self.url = bytearray()
        self.body = bytearray()
        self.requests: deque[tuple[str, str, bytes, bool]] = deque()  # method, path, body, keep alive
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a paced stream is being written: answer the next request after it
        self.timer: asyncio.TimerHandle | None = None
        self.close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            refused = exc.__context__  # what one of our callbacks raised
            if isinstance(refused, _Refused):
                self._fail(refused.status, str(refused))
                return
            self._fail(400, f"bad request: {exc}")
            return
        if not self.busy:
            self._serve_queued()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.head_bytes = 0
        self.url.clear()
        self.body.clear()

    def on_url(self, url: bytes) -> None:
        self._count_head(url)
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(name + value)
        if name.lower() == b"content-length" and value.strip().isdigit() and int(value) > MAX_BODY_BYTES:
            raise _Refused(413, "request body too large")

    def on_body(self, body: bytes) -> None:
        self.body += body
        if len(self.body) > MAX_BODY_BYTES:
            raise _Refused(413, "request body too large")

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode("latin-1")
        path = bytes(self.url).split(b"?", 1)[0].decode("latin-1")
        self.requests.append((method, path, bytes(self.body), self.parser.should_keep_alive()))

    def _count_head(self, data: bytes) -> None:
        self.head_bytes += len(data)
        if self.head_bytes > MAX_HEAD_BYTES:
            raise _Refused(400, "request head too large")

    def _serve_queued(self) -> None:
        while self.transport is not None and not self.busy and self.requests:
            method, path, body, keep_alive = self.requests.popleft()
            self.close_after = not keep_alive
            self._answer(method, path, body)
            if self.close_after and not self.busy and self.transport is not None:
                self.transport.close()

    def _fail(self, status: int, message: str) -> None:
        if self.transport is None:
            return
        self.transport.write(_error(status, message))
        self.transport.close()

    def _answer(self, method: str, path: str, body: bytes) -> None:
        assert self.transport is not None
        server = self.server
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            try:
                req = json.loads(body)
                max_tokens = req.get("max_completion_tokens") or req.get("max_tokens") or 16
                stream = req.get("stream") is True
                usage = bool((req.get("stream_options") or {}).get("include_usage"))
                if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 4096:
                    raise ValueError
            except (ValueError, AttributeError, TypeError):
                self.transport.write(_error(400, "not a completion request this instance understands"))
                return
            chat = path == "/v1/chat/completions"
            server.requests += 1
            if not stream:
                self.transport.write(server.answers.plain(chat, max_tokens))
                return
            chunks = server.answers.stream(chat, max_tokens, usage)
            if server.itl_s <= 0 or len(chunks) == 1:
                self.transport.write(b"".join(chunks))
                return
            self.transport.write(chunks[0])
            self.busy = True
            self.timer = asyncio.get_running_loop().call_later(server.itl_s, self._next_token, chunks, 1)
            return
        if method == "GET":
            data = server.answers.info(path, server.name)
            if data is not None:
                self.transport.write(data)
                return
        self.transport.write(_error(404, f"no route {method} {path}"))

    def _next_token(self, chunks: tuple[bytes, ...], i: int) -> None:
        self.timer = None
        if self.transport is None:
            return
        self.transport.write(chunks[i])
        if i + 1 < len(chunks):
            self.timer = asyncio.get_running_loop().call_later(self.server.itl_s, self._next_token, chunks, i + 1)
            return
        self.busy = False
        if self.close_after:
            self.transport.close()
            return
        self._serve_queued()


class TrivialServer:
    def __init__(self, name: str = "trivial-0", model: str = DEFAULT_MODEL, itl_ms: float = 0.0) -> None:
        self.name = name
        self.answers = Answers(model)
        self.itl_s = itl_ms / 1000.0
        self.requests = 0
        self.url = ""
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, backlog=1024)
        bound = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


async def start_trivial_fleet(count: int, base_port: int = 0, *, host: str = "127.0.0.1",
                              itl_ms: float = 0.0, model: str = DEFAULT_MODEL) -> list[TrivialServer]:
    """`count` instances on base_port.. (0: free ports), named trivial-0.."""
    servers = []
    try:
        for i in range(count):
            server = TrivialServer(f"trivial-{i}", model, itl_ms)
            await server.start(host, base_port + i if base_port else 0)
            servers.append(server)
    except BaseException:
        for s in servers:
            await s.close()
        raise
    return servers


async def _serve(args: argparse.Namespace) -> int:
    servers = await start_trivial_fleet(args.count, args.port, host=args.host, itl_ms=args.itl_ms,
                                        model=args.model)
    for s in servers:
        print(f"{s.name} listening on {s.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers:
        await s.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000, help="port of the first instance (0: any free ports)")
    p.add_argument("--count", type=int, default=1, help="instances, on consecutive ports")
    p.add_argument("--itl-ms", type=float, default=0.0, help="milliseconds between two streamed tokens (0: at once)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(args))
    return uvloop.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
