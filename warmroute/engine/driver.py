"""Runs an EngineModel in scaled real time and hands its events to the requests waiting on them.

One asyncio task per instance: take a step, sleep its modelled duration × time_scale, deliver the tokens.
Sleeping against a running deadline (not "duration after the previous wake-up") keeps the emulated
throughput right even when the event loop is late by a little; when it is late by a lot (an overloaded
host), the lag is dropped rather than repaid in a burst, and counted (`behind_s`, exported as
warmroute_emulation_behind_seconds_total): the emulation then ran slower than the engine it models.

Pure-decode stretches are fused into one model call and one sleep (few wake-ups on a busy 2-core host),
capped at MAX_FUSED_S of real time so that streams still receive tokens steadily. A new request cuts a
fused stretch short at the end of the step in flight, where a real engine would admit it.

A remote sequence (disaggregated decode) is admitted like any other, then waits for its KV: the driver sets its
stream's `load_started` with the tokens to load, and whoever moves them reports back (`landed`); held blocks of a
prefill are freed by `release`. Both take effect at the next step boundary, as arrivals do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from warmroute.engine.model import EngineModel, StepResult

log = logging.getLogger(__name__)

MAX_FUSED_S = 0.02  # longest real-time stretch of decode steps delivered at once
MAX_LAG_S = 0.1  # further behind the deadline than this, the lag is forgiven


@dataclass(eq=False)
class TokenStream:
    """One request's progress, as the handler sees it; `changed()` wakes when any of it changes."""

    seq_id: int
    every_token: bool = True  # wake on each token (streaming), or only when finished
    generated: int = 0
    cached_tokens: int = 0
    finished: bool = False
    failed: bool = False  # the driver stopped (shutdown or a bug), or its KV never came: no more tokens will come
    error: str | None = None  # why it failed, when its KV never came
    load_tokens: int = 0  # prompt tokens it loads from another instance, once admitted
    load_started: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _event: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    async def changed(self) -> None:
        await self._event.wait()
        self._event.clear()

    def _notify(self) -> None:
        self._event.set()


class EngineDriver:
    def __init__(self, model: EngineModel, time_scale: float = 1.0) -> None:
        if time_scale < 0:
            raise ValueError("time scale must be >= 0")
        self.model = model
        self.time_scale = time_scale
        self._streams: dict[int, TokenStream] = {}
        self._ids = count()
        self._arrival = asyncio.Event()
        self._incoming: dict[int, tuple[tuple[Any, ...], dict[str, bool]]] = {}
        self._landed: dict[int, tuple[bool, bool]] = {}  # seq -> (arrived, recompute if not) for the next step
        self._releases: list[int] = []  # held sequences whose blocks go at the next step
        self._task: asyncio.Task[None] | None = None
        self.behind_s = 0.0  # real seconds the host made it fall behind its schedule, skipped rather than repaid

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-driver")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._fail_all()

    def submit(self, blocks: Sequence[int], prompt_tokens: int, max_tokens: int,
               every_token: bool = True, token_ids: Sequence[int] = (), *, remote: bool = False,
               hold: bool = False, cache: bool = True) -> TokenStream:
        """Queue a sequence in the model (ValueError if it can never fit) and return its stream (`remote`,
        `hold`, `cache`: see EngineModel.submit)."""
        self.model.check(blocks, prompt_tokens, max_tokens)
        stream = TokenStream(next(self._ids), every_token)
        # The model only changes between steps (the driver hands it new sequences at step boundaries), so
        # a decode stretch cut short by this arrival still runs as the decode steps it was.
        self._incoming[stream.seq_id] = ((blocks, prompt_tokens, max_tokens, token_ids),
                                         {"remote": remote, "hold": hold, "cache": cache})
        self._streams[stream.seq_id] = stream
        self._arrival.set()
        return stream

    def cancel(self, stream: TokenStream) -> None:
        """Forget a request (its client left); a no-op once it has finished."""
        if self._streams.pop(stream.seq_id, None) is not None:
            self._landed.pop(stream.seq_id, None)
            if self._incoming.pop(stream.seq_id, None) is None:
                self.model.cancel(stream.seq_id)

    def landed(self, stream: TokenStream, arrived: bool, recompute: bool = False) -> None:
        """A remote sequence's KV arrived, or did not (then it is computed here if `recompute`, else it fails)."""
        if stream.seq_id in self._streams:
            self._landed[stream.seq_id] = (arrived, recompute)
            self._arrival.set()

    def release(self, stream: TokenStream) -> None:
        """Free the blocks a finished hold sequence keeps."""
        self._releases.append(stream.seq_id)
        self._arrival.set()

    def _hand_over(self) -> None:
        """Give the model the sequences that arrived, the KV that landed and the blocks let go since the last step."""
        model = self.model
        for seq_id, (args, options) in self._incoming.items():
            model.submit(seq_id, *args, **options)
        self._incoming.clear()
        for seq_id, (arrived, recompute) in self._landed.items():
            if arrived:
                model.loaded(seq_id)
            elif model.load_failed(seq_id, recompute) and not recompute:
                self._fail(seq_id, "the prompt's KV cache could not be loaded from the remote instance")
        self._landed.clear()
        for seq_id in self._releases:
            model.release(seq_id)
        self._releases.clear()

    # -- the loop --------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        try:
            while True:
                if self.model.stalled and not (self._incoming or self._landed or self._releases):
                    self._arrival.clear()
                    await self._arrival.wait()
                    deadline = loop.time()  # idle time is not owed to anyone
                self._hand_over()
                deadline = self._forgive(deadline, loop.time())
                result, deadline = await self._advance(deadline)
                self._deliver(result)
        except Exception:
            log.exception("engine driver stopped")
            self._fail_all()
            raise

    def _forgive(self, deadline: float, now: float) -> float:
        """The deadline, moved up to MAX_LAG_S before `now` if it was further behind (the skipped lag is added to
        behind_s)."""
        floor = now - MAX_LAG_S
        if deadline >= floor:
            return deadline
        self.behind_s += floor - deadline
        return floor

    async def _advance(self, deadline: float) -> tuple[StepResult, float]:
        """Take one step (or a fused decode stretch) and sleep until it ends; returns it and the new deadline."""
        fusible = self.model.fusible_decode_steps()
        step_s = self.model.decode_step_seconds * self.time_scale
        if fusible <= 1 or step_s == 0:
            result = self.model.step(max(fusible, 1))
            deadline += result.duration * self.time_scale
            await _sleep_until(deadline)
            return result, deadline
        k = min(fusible, max(1, int(MAX_FUSED_S / step_s)))
        self._arrival.clear()
        try:
            # not wait_for: on Python 3.11 it drops a cancel (close()) that meets an arrival
            async with asyncio.timeout(max(0.0, deadline + k * step_s - _now())):
                await self._arrival.wait()
            # a request arrived: finish the step in flight, then let the model admit it
            # (at least one: the deadline may still be ahead when the request arrives early)
            k = min(k, max(1, int((_now() - deadline) / step_s) + 1))
            await _sleep_until(deadline + k * step_s)
        except TimeoutError:
            pass
        result = self.model.step(k)
        return result, deadline + result.duration * self.time_scale

    def _deliver(self, result: StepResult) -> None:
        # A stream may be gone: its client left while the step that served it was being slept.
        streams = self._streams
        for seq_id, n in result.loads.items():
            if (stream := streams.get(seq_id)) is not None:
                stream.load_tokens = n
                stream.load_started.set()
        for seq_id, cached in result.first_tokens.items():
            if (stream := streams.get(seq_id)) is not None:
                stream.cached_tokens = cached
        for seq_id, n in result.tokens.items():
            if (stream := streams.get(seq_id)) is not None:
                stream.generated += n
                if stream.every_token:
                    stream._notify()
        for seq_id in result.finished:
            if (stream := streams.pop(seq_id, None)) is not None:
                stream.finished = True
                stream._notify()

    def _fail(self, seq_id: int, error: str) -> None:
        if (stream := self._streams.pop(seq_id, None)) is not None:
            stream.failed, stream.error = True, error
            stream._notify()

    def _fail_all(self) -> None:
        for stream in self._streams.values():
            stream.failed = True
            stream._notify()
        self._streams.clear()


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _sleep_until(deadline: float) -> None:
    await asyncio.sleep(max(0.0, deadline - _now()))  # sleep(0) still yields to the handlers
