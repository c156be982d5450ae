"""Disaggregated prefill/decode for the emulated engine: vLLM's NixlConnector and SGLang's bootstrap handoff.

NIXL (`mode="nixl"`, vLLM's kv_both: each request's body says which leg it is):
  * Prefill leg: `kv_transfer_params.do_remote_decode`. Prefilled as usual (prefix cache included); its prompt's
    blocks stay held when it finishes, and the response's top-level `kv_transfer_params` are those vLLM 0.32's
    NixlConnector.request_finished builds, plus the scheduler's remote_prefill_cached_tokens. The blocks are freed
    when the decode side says it has read them, or when their lease (`lease_s`, vLLM's kv_lease_duration) runs
    out; a decode side still waiting for its turn renews it every lease/6, by 2/3 of a lease (vLLM's heartbeats).
  * Decode leg: `kv_transfer_params.do_remote_prefill` and the remote_* fields. Its local prefix hit first, then
    the rest of the prompt is read through the prefill instance's side channel (POST /kv_transfer/read, then
    /kv_transfer/done), taking tokens / transfer_tokens_per_s; the loaded blocks enter its prefix cache. An
    unreachable remote, or another engine id there, fails the request (`failure_policy` "fail", vLLM's default
    kv_load_failure_policy: HTTP 500) or has it computed here ("recompute"). Blocks that are gone are read
    anyway, as NIXL's one-sided read does: the prefill side counts vllm:nixl_num_notifications_after_expiry.
SGLang (`mode="bootstrap"`, each instance's `role` fixed): both legs carry bootstrap_host, bootstrap_port and
  bootstrap_room. The prefill instance prefills (one token), keeps the room's KV until the decode instance has
  read it (POST /kv_transfer/read with the room, which waits for it), and answers then. The decode instance
  neither uses nor feeds its prefix cache (SGLang's default), waits at most `bootstrap_timeout_s` for the room's
  KV, and fails (HTTP 500) without it.
Timeouts and leases are real seconds, not scaled by time_scale: they guard against lost peers.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
from aiohttp import web

from warmroute.engine.metrics import Histogram
from warmroute.engine.model import external_hash

if TYPE_CHECKING:
    from warmroute.engine.driver import EngineDriver, TokenStream

log = logging.getLogger("warmroute.engine")

MODES = ("nixl", "bootstrap")
ROLES = ("prefill", "decode", "both")
FAILURE_POLICIES = ("fail", "recompute")
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default, for a leg that names none
READ_TIMEOUT_S = 10.0  # a side-channel call that is not a wait for a room
NIXL_TRANSFER_MODE = "pull"  # vLLM's NixlConnector reads (pulls) the blocks from the prefill instance


class TransferFailed(Exception):
    """A leg could not move its KV: the request ends with HTTP 500, as vLLM's and SGLang's do."""


@dataclass(frozen=True)
class TransferConfig:
    mode: Literal["nixl", "bootstrap"]
    role: Literal["prefill", "decode", "both"] = "both"  # bootstrap: the instance's fixed role
    transfer_tokens_per_s: float = 200_000.0  # KV moved per modelled second (a 200 Gb/s-class RDMA link at 8b)
    kv_bytes_per_token: int = 128 * 1024  # for vllm:nixl_bytes_transferred (the 8b profile's KV per token)
    lease_s: float = 30.0  # vLLM's kv_lease_duration
    failure_policy: Literal["fail", "recompute"] = "fail"  # vLLM's kv_load_failure_policy
    bootstrap_timeout_s: float = 300.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT / _WAITING_TIMEOUT

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown KV transfer {self.mode!r}; choose from {', '.join(MODES)}")
        if self.role not in ROLES:
            raise ValueError(f"unknown P/D role {self.role!r}; choose from {', '.join(ROLES)}")
        if (self.mode == "bootstrap") != (self.role != "both"):
            raise ValueError("a bootstrap instance is either prefill or decode; a nixl one takes both legs")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"unknown KV load failure policy {self.failure_policy!r}")
        if self.transfer_tokens_per_s <= 0 or self.kv_bytes_per_token < 1:
            raise ValueError("the transfer rate and the KV bytes per token must be positive")
        if self.lease_s <= 0 or self.bootstrap_timeout_s <= 0:
            raise ValueError("the lease and the bootstrap timeout must be positive")


@dataclass
class TransferStats:
    """What vLLM's NixlConnector reports (vllm:nixl_*): transfers on the reading side, expiries on the held side."""

    xfer_time: Histogram = field(default_factory=lambda: Histogram(
        (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)))
    post_time: Histogram = field(default_factory=lambda: Histogram(
        (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)))
    bytes_transferred: Histogram = field(default_factory=lambda: Histogram(
        tuple(2 ** (10 + i) for i in range(1, 25, 2))))
    descriptors: Histogram = field(default_factory=lambda: Histogram(
        (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)))
    failed_transfers: int = 0
    failed_notifications: int = 0
    kv_expired_reqs: int = 0
    notifications_after_expiry: int = 0


@dataclass(frozen=True)
class Leg:
    """What a request is in a disaggregated exchange: a prefill leg (its KV kept for another instance) or a
    decode leg (its KV read from `url`, the instance holding `key`: vLLM's request id or SGLang's room)."""

    prefill: bool
    key: str | int | None = None  # a bootstrap prefill's room; a decode leg's remote request id or room
    url: str = ""  # a decode leg's side channel
    engine_id: str | None = None  # the engine a nixl decode leg reads from
    remote_cached: int | None = None  # remote_prefill_cached_tokens, reported as the decode leg's cached_tokens

    @property
    def decode(self) -> bool:
        return not self.prefill


@dataclass(eq=False)
class _Held:
    """A finished prefill's prompt blocks, kept for the decode side."""

    stream: TokenStream
    block_ids: list[int]
    hashes: list[int]  # the prompt's full blocks, as vLLM's events name them
    tokens: int
    expires: float = 0.0  # loop time (nixl)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class KvTransfer:
    """One instance's side of disaggregated serving: the legs it runs, the KV it holds and its side channel."""

    def __init__(self, config: TransferConfig, driver: EngineDriver, block_size: int) -> None:
        self.config = config
        self.driver = driver
        self.block_size = block_size
        self.engine_id = str(uuid.uuid4())  # vLLM's default kv_transfer_config.engine_id
        self.stats = TransferStats()
        self.host, self.port = "localhost", 0  # where the decode side reaches this one (set by bind)
        self._held: dict[str | int, _Held] = {}
        self._rooms: dict[int, asyncio.Future[_Held]] = {}
        self._timers: dict[str | int, asyncio.TimerHandle] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._session: aiohttp.ClientSession | None = None

    @property
    def nixl(self) -> bool:
        return self.config.mode == "nixl"

    def bind(self, host: str, port: int) -> None:
        self.host = "localhost" if host in ("0.0.0.0", "::", "") else host  # vLLM's side-channel host default
        self.port = port

    async def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/kv_transfer/read", self._read)
        app.router.add_post("/kv_transfer/done", self._done)
        app.router.add_post("/kv_transfer/heartbeat", self._heartbeat)

    def server_info(self) -> dict[str, Any]:
        mode = self.config.role if self.config.mode == "bootstrap" else "null"
        return {"disaggregation_mode": mode, "kv_transfer": self.config.mode, "kv_engine_id": self.engine_id}

    # -- legs --------------------------------------------------------------------------------------------------
    def leg(self, body: dict[str, Any]) -> Leg | None:
        """The leg a request body asks for (None: a whole request). ValueError for a malformed one."""
        return self._nixl_leg(body) if self.nixl else self._bootstrap_leg(body)

    def _nixl_leg(self, body: dict[str, Any]) -> Leg | None:
        params = body.get("kv_transfer_params")
        if params is None:
            return None
        if not isinstance(params, dict):
            raise ValueError("'kv_transfer_params' must be an object")
        if params.get("do_remote_decode"):
            return Leg(prefill=True)
        if not params.get("do_remote_prefill"):
            return None
        fields = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")
        if not all(params.get(f) for f in fields):
            log.warning("kv_transfer_params without %s: the prompt is computed here", ", ".join(fields))
            return None  # vLLM: "Got invalid KVTransferParams ... will not utilize KVTransfer"
        cached = params.get("remote_prefill_cached_tokens")
        return Leg(prefill=False, key=str(params["remote_request_id"]),
                   url=_base_url(str(params["remote_host"]), params["remote_port"]),
                   engine_id=str(params["remote_engine_id"]),
                   remote_cached=cached if isinstance(cached, int) and not isinstance(cached, bool) else None)

    def _bootstrap_leg(self, body: dict[str, Any]) -> Leg:
        room = body.get("bootstrap_room")
        if not isinstance(room, int) or isinstance(room, bool):
            raise ValueError(f"a {self.config.role} instance takes only requests with an integer 'bootstrap_room'")
        if self.config.role == "prefill":
            return Leg(prefill=True, key=room)
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        if not isinstance(host, str) or not host:
            raise ValueError("'bootstrap_host' must name the prefill instance")
        return Leg(prefill=False, key=room, url=_base_url(host, port or SGLANG_BOOTSTRAP_PORT))

    def start(self, leg: Leg, stream: TokenStream, hashes: Sequence[bytes],
              prompt_tokens: int) -> asyncio.Task[None] | None:
        """Start what a decode leg does while it waits: renew its lease, then read its KV when admitted."""
        if leg.prefill:
            return None
        return asyncio.create_task(self._pull(leg, stream, hashes, prompt_tokens), name="kv-pull")

    async def settle(self, leg: Leg, stream: TokenStream, request_id: str, hashes: Sequence[bytes],
                     prompt_tokens: int) -> dict[str, Any]:
        """A leg's part once its tokens are out: the response fields it adds. TransferFailed if its KV was lost."""
        if leg.decode:
            if leg.remote_cached is not None:
                stream.cached_tokens = leg.remote_cached  # vLLM reports the prefill side's cache hits
            return {"kv_transfer_params": None} if self.nixl else {}
        held = _Held(stream, self.driver.model.held_block_ids(stream.seq_id),
                     [external_hash(h) for h in hashes], prompt_tokens)
        if self.nixl:
            return {"kv_transfer_params": self._lend(request_id, held, stream.cached_tokens)}
        await self._hand_room(leg.key, held)
        return {}

    # -- prefill side --------------------------------------------------------------------------------------------
    def _lend(self, request_id: str, held: _Held, cached_tokens: int) -> dict[str, Any]:
        """Keep a NIXL prefill's blocks under a lease; the kv_transfer_params that name them."""
        loop = asyncio.get_running_loop()
        held.expires = loop.time() + self.config.lease_s
        self._held[request_id] = held
        self._timers[request_id] = loop.call_later(self.config.lease_s, self._expire, request_id)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [held.block_ids],
                "remote_engine_id": self.engine_id, "remote_request_id": request_id,
                "remote_host": self.host, "remote_port": self.port, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                "remote_num_tokens": held.tokens, "remote_blocks_expiry_time": None,
                "transfer_mode": NIXL_TRANSFER_MODE, "remote_prefill_cached_tokens": cached_tokens}

    def _expire(self, key: str) -> None:
        held = self._held.get(key)
        if held is None:
            return
        left = held.expires - asyncio.get_running_loop().time()
        if left > 0:  # renewed by a heartbeat
            self._timers[key] = asyncio.get_running_loop().call_later(left, self._expire, key)
            return
        log.warning("releasing the KV blocks of %s: its lease ran out before a decode instance read them", key)
        self.stats.kv_expired_reqs += 1
        self._free(key)

    async def _hand_room(self, room: str | int | None, held: _Held) -> None:
        """Offer a bootstrap prefill's KV to its room and wait until the decode instance has read it."""
        assert isinstance(room, int)
        self._held[room] = held
        future = self._room(room)
        if not future.done():
            future.set_result(held)
        try:
            await asyncio.wait_for(held.done.wait(), self.config.bootstrap_timeout_s)
        except TimeoutError:
            raise TransferFailed(f"no decode instance took the KV of bootstrap room {room}") from None
        finally:
            self._free(room)
            self._rooms.pop(room, None)

    def _room(self, room: int) -> asyncio.Future[_Held]:
        if room not in self._rooms:
            self._rooms[room] = asyncio.get_running_loop().create_future()
        return self._rooms[room]

    def _free(self, key: str | int) -> None:
        held = self._held.pop(key, None)
        if (timer := self._timers.pop(key, None)) is not None:
            timer.cancel()
        if held is not None:
            self.driver.release(held.stream)
            held.done.set()

    # -- the side channel (served by the instance that holds the KV) ---------------------------------------------
    async def _read(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if body.get("engine_id") not in (None, self.engine_id):
            return web.json_response({"error": f"this is engine {self.engine_id}"}, status=409)
        if "room" in body:
            held = await self._wait_room(body["room"], float(body.get("wait_s", self.config.bootstrap_timeout_s)))
        else:
            held = self._held.get(str(body.get("request_id")))
        if held is None:
            return web.json_response({"engine_id": self.engine_id, "known": False})
        return web.json_response({"engine_id": self.engine_id, "known": True, "block_ids": held.block_ids,
                                  "block_hashes": held.hashes, "num_tokens": held.tokens})

    async def _wait_room(self, room: Any, wait_s: float) -> _Held | None:
        if not isinstance(room, int):
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(self._room(room)),
                                          min(wait_s, self.config.bootstrap_timeout_s))
        except TimeoutError:
            if not self._room(room).done():
                self._rooms.pop(room, None)
            return None

    async def _done(self, request: web.Request) -> web.Response:
        """The decode side read the blocks (or gave up on them): free them."""
        body = await _json(request)
        key = body["room"] if "room" in body else str(body.get("request_id"))
        if key in self._held:
            self._free(key)
        elif self.nixl:
            log.warning("a decode instance read the KV of %s after its lease ran out", key)
            self.stats.notifications_after_expiry += 1
        return web.json_response({})

    async def _heartbeat(self, request: web.Request) -> web.Response:
        """Renew the leases of blocks a decode instance still means to read."""
        body = await _json(request)
        expires = asyncio.get_running_loop().time() + self.config.lease_s * 2 / 3
        for key in body.get("request_ids", ()):
            if (held := self._held.get(str(key))) is not None:
                held.expires = max(held.expires, expires)
        return web.json_response({})

    # -- decode side ---------------------------------------------------------------------------------------------
    async def _pull(self, leg: Leg, stream: TokenStream, hashes: Sequence[bytes], prompt_tokens: int) -> None:
        try:
            await self._await_admission(leg, stream)
            arrived = await self._transfer(leg, stream, hashes, prompt_tokens)
        except asyncio.CancelledError:
            self._spawn(self._notify(leg))  # vLLM's decode side frees the remote blocks of a request it aborts
            raise
        if arrived:
            self._spawn(self._notify(leg))  # not awaited: the request may end (and cancel this) first
        recompute = self.nixl and self.config.failure_policy == "recompute"
        self.driver.landed(stream, arrived, recompute)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _await_admission(self, leg: Leg, stream: TokenStream) -> None:
        """Wait until the model admits the sequence; meanwhile renew the NIXL lease on its remote blocks."""
        beat = self.config.lease_s / 6
        while not stream.load_started.is_set():
            if self.nixl:
                await self._post(leg.url + "/kv_transfer/heartbeat", {"request_ids": [leg.key]}, quiet=True)
            try:
                await asyncio.wait_for(stream.load_started.wait(), beat)
            except TimeoutError:
                pass

    async def _transfer(self, leg: Leg, stream: TokenStream, hashes: Sequence[bytes], prompt_tokens: int) -> bool:
        """Read the tokens the sequence needs from the remote instance, in modelled transfer time. False if it
        could not."""
        tokens = stream.load_tokens
        wait_s = 0.0 if self.nixl else self.config.bootstrap_timeout_s  # a room's KV may not be there yet
        ask = ({"engine_id": leg.engine_id, "request_id": leg.key, "tokens": tokens} if self.nixl
               else {"room": leg.key, "tokens": tokens, "wait_s": wait_s})
        reply = await self._post(leg.url + "/kv_transfer/read", ask, timeout=READ_TIMEOUT_S + wait_s)
        if reply is None:
            self.stats.failed_transfers += 1
            return False
        if not reply.get("known", False) and not self.nixl:
            log.warning("bootstrap room %s: no KV came from %s", leg.key, leg.url)
            return False
        self._check_hashes(leg, reply, hashes, (prompt_tokens - tokens) // self.block_size)
        seconds = tokens / self.config.transfer_tokens_per_s
        await asyncio.sleep(seconds * self.driver.time_scale)
        self._count_transfer(seconds, tokens)
        return True

    def _check_hashes(self, leg: Leg, reply: dict[str, Any], hashes: Sequence[bytes], first: int) -> None:
        """Warn when the remote blocks (full blocks `first`.. are read) hold another prompt: the engine would
        decode from the wrong KV, as vLLM would."""
        if not reply.get("known"):
            log.warning("%s: the remote blocks of %s may have been reused (their lease ran out)", leg.url, leg.key)
            return
        remote: list[int] = reply.get("block_hashes", [])
        ours = [external_hash(h) for h in hashes]
        if any(i >= len(remote) or remote[i] != ours[i] for i in range(first, len(ours))):
            log.warning("%s: the KV read for %s is of another prompt than this request's", leg.url, leg.key)

    def _count_transfer(self, seconds: float, tokens: int) -> None:
        stats = self.stats
        stats.xfer_time.observe(seconds)
        stats.post_time.observe(0.0)  # posting a transfer costs nothing in the emulation
        stats.bytes_transferred.observe(tokens * self.config.kv_bytes_per_token)
        stats.descriptors.observe(-(-tokens // self.block_size))  # one per block read

    async def _notify(self, leg: Leg) -> None:
        """Tell the holder it may free the blocks (vLLM's completion notification)."""
        key = {"request_id": leg.key} if self.nixl else {"room": leg.key}
        if await self._post(leg.url + "/kv_transfer/done", key, quiet=True) is None:
            self.stats.failed_notifications += 1

    async def _post(self, url: str, body: dict[str, Any], timeout: float = READ_TIMEOUT_S,
                    quiet: bool = False) -> dict[str, Any] | None:
        """POST to a peer's side channel: its JSON answer, or None (logged unless quiet) if it failed."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status == 200:
                    return await resp.json()
                problem = f"HTTP {resp.status}: {(await resp.text())[:200]}"
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            problem = repr(exc)
        if not quiet:
            log.warning("KV transfer side channel %s failed: %s", url, problem)
        return None


def _base_url(host: str, port: Any) -> str:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"a KV transfer port must be an integer port number, not {port!r}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text="the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body
