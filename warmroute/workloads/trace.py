"""Mooncake-format trace replay (JSONL: `timestamp` ms, `input_length`, `output_length`, `hash_ids`).

Each hash id stands for one 512-token block, chained: requests whose first k ids are equal share their first
k*512 tokens. Each id is mapped to a fixed pseudo-random text block (`block_text`), the blocks are joined and
cut to input_length*4 characters, and the result is sent as a /v1/completions prompt, so the router and the
engine see exactly the prefix sharing the trace recorded. `arrival_s` is the timestamp in seconds; drivers
divide it by their speed-up factor.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from warmroute.errors import UsageError
from warmroute.workloads.base import Workload
from warmroute.workloads.request import Session, completion_request
from warmroute.workloads.text import BLOCK_TOKENS, block_text, chars_for, filler, rng_for


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_record(line: str, where: str) -> TraceRecord:
    """One trace line; `where` names it ("FILE:LINE") in the error."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: expected a JSON object")
    ts, n_in, n_out, ids = (raw.get(k) for k in ("timestamp", "input_length", "output_length", "hash_ids"))
    if not _number(ts) or ts < 0:
        raise UsageError(f"{where}: 'timestamp' must be a number of milliseconds >= 0")
    if not _integer(n_in) or n_in < 1 or not _integer(n_out) or n_out < 0:
        raise UsageError(f"{where}: 'input_length' must be an integer >= 1 and 'output_length' >= 0")
    if not isinstance(ids, list) or not all(_integer(i) for i in ids):
        raise UsageError(f"{where}: 'hash_ids' must be a list of integers")
    return TraceRecord(float(ts), n_in, n_out, tuple(ids))


def _integer(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def load_trace(path: str, limit: int | None = None) -> list[TraceRecord]:
    """The first `limit` records (all if None) of a trace file; blank lines are skipped."""
    records: list[TraceRecord] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(records) >= limit:
                    break
                if line.strip():
                    records.append(parse_record(line, f"{path}:{lineno}"))
    except OSError as exc:
        raise UsageError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"cannot read trace {path}: not UTF-8 text") from None
    if not records:
        raise UsageError(f"trace {path} has no requests")
    return records


def trace_prompt(record: TraceRecord, index: int) -> str:
    """The record's prompt: its blocks' fixed texts, cut (or, past the last block, padded) to its length."""
    n_chars = chars_for(record.input_length)
    text = "".join(block_text(i) for i in record.hash_ids[: -(-n_chars // chars_for(BLOCK_TOKENS))])
    if len(text) < n_chars:  # more tokens than blocks: pad with text unique to this request
        text += filler(rng_for(0, "trace-pad", index), n_chars - len(text))
    return text[:n_chars]


@dataclass
class TraceReplay(Workload):
    name: ClassVar[str] = "trace"
    path: str = ""
    limit: int | None = None  # replay only the first `limit` requests
    max_tokens: int = 0  # 0: each request's output_length; otherwise a cap on it
    start_s: float = 0.0  # replay from this many seconds into the trace (its earlier requests skipped)

    def validate(self) -> None:  # max_tokens 0 is allowed here: it means "the trace's own lengths"
        if not self.path:
            raise UsageError("the trace workload needs a trace file (--trace FILE)")
        if self.limit is not None and self.limit < 1:
            raise UsageError("--trace-limit must be >= 1")
        if not 0.0 <= self.start_s < float("inf"):
            raise UsageError("the trace's start_s must be a number of seconds >= 0")
        _ = self.records  # read and check the file now, so a bad trace fails before any request is sent

    @cached_property
    def records(self) -> list[TraceRecord]:
        return load_trace(self.path, self.limit)

    def sessions(self) -> Iterator[Session]:
        start_ms = self.start_s * 1000
        for index, rec in enumerate(self.records):
            if rec.timestamp_ms < start_ms:
                continue
            sid = f"{self.name}-{index}"
            yield Session(sid, (completion_request(
                self.model, trace_prompt(rec, index), tag=self.name, session=sid,
                max_tokens=self.output_tokens(rec), arrival_s=(rec.timestamp_ms - start_ms) / 1000,
            ),))

    def output_tokens(self, rec: TraceRecord) -> int:
        n = max(1, rec.output_length)
        return min(n, self.max_tokens) if self.max_tokens > 0 else n

    def working_set_tokens(self, concurrency: int = 1) -> int:
        """Tokens of the blocks that more than one request uses (the reusable part of the trace)."""
        uses = Counter(i for rec in self.records for i in rec.hash_ids)
        return BLOCK_TOKENS * sum(1 for n in uses.values() if n > 1)
