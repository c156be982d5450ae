"""The emulated engine's scheduler and KV cache: pure, no I/O, no clock; the caller advances it.

The HTTP server drives it in (scaled) real time; the simulator drives it in virtual time. Both see the same
behaviour, modelled on vLLM's V1 scheduler:

  * Paged KV cache = the engine's own `block_pool.BlockPool` (kv_capacity_tokens // block_size blocks, an
    LRU free queue, reference counts). A sequence is identified by the chained hashes of its prompt's full
    blocks (the HTTP engine: `kv_hash.block_hashes` of its token ids) and its prompt length in tokens.
  * Admission: at most `max_running` sequences run; the rest wait, first come first served (the head blocks
    the queue, as in vLLM). A sequence is admitted only when it can take its cached prefix and fresh blocks
    for the rest of its prompt and all its output tokens, from the front of the free queue (evicting what
    those held).
  * Prefix hits: the leading cached full blocks, at most (prompt_tokens - 1) // block_size of them (vLLM
    always recomputes the last prompt token). Counted in tokens, once per request, at admission, like
    vLLM's prefix_cache_queries_total / prefix_cache_hits_total.
  * Chunked prefill: each step has a budget of `max_batched_tokens`: one token per decoding sequence, then
    prefill chunks of running sequences, then newly admitted ones. A prompt block enters the prefix cache
    (visible to other sequences) once the step that computes it ends.
  * A sequence's first token comes at the end of the step that completes its prefill; then one token per
    step until max_tokens. Output blocks are reserved up front, so nothing is ever preempted.
  * Step duration: `profiles.Timing.step_ms`.
  * Disaggregated prefill/decode (vLLM's KV connectors): a `remote` sequence takes its local prefix hit and
    blocks like any other, then waits, computing nothing, while the rest of its prompt's KV is loaded from
    another instance (`StepResult.loads`; the caller moves it and says `loaded` or `load_failed`). Loaded
    full blocks enter the prefix cache; the last prompt token is then computed again for its logits. A `hold`
    sequence keeps its prompt's blocks when it finishes, for another instance to read, until `release`.

API:
    model = EngineModel(EngineConfig.from_profile("8b"))
    model.submit(seq_id, blocks, prompt_tokens, max_tokens)   # ValueError if it can never fit
    model.cancel(seq_id) -> bool                               # frees its blocks wherever it is
    model.loaded(seq_id), load_failed(seq_id, recompute)      # a remote sequence's KV arrived, or did not
    model.held_block_ids(seq_id), release(seq_id)              # a hold sequence's kept prompt blocks
    model.step(max_decode_steps=1) -> StepResult               # duration (s) and events
    model.fusible_decode_steps() -> int                        # pure-decode steps before the batch changes
    model.decode_step_seconds                                  # duration of one such step
    model.idle, stalled, num_running, num_waiting, kv_usage, stats (EngineStats), config, pool (BlockPool)

Fusing: when no sequence is prefilling and no waiting one can be admitted, the next steps are
pure decode with an unchanged batch until a sequence finishes; `step(k)` runs min(k, fusible) of them in
one call, with the same result as that many single steps. A caller with a horizon (the next arrival)
passes k = how many decode steps fit before it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from warmroute.engine.block_pool import BlockPool, KVBlock
from warmroute.engine.profiles import PROFILES, Timing

SeqId = Hashable


@dataclass(frozen=True)
class EngineConfig:
    timing: Timing
    kv_capacity_tokens: int
    block_size: int = 16  # tokens per KV block (vLLM's default)
    max_running: int = 256  # vLLM's max_num_seqs
    max_batched_tokens: int = 8192  # vLLM's max_num_batched_tokens: tokens one step may compute

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block size must be at least 1 token")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError("KV capacity must hold at least one block")
        if self.max_running < 1:
            raise ValueError("max running sequences must be at least 1")
        if self.max_batched_tokens < self.max_running:
            raise ValueError("max batched tokens must be at least max running (one decode token each)")

    @classmethod
    def from_profile(cls, profile: str = "8b", *, kv_capacity_tokens: int | None = None,
                     prefill_tokens_per_s: float | None = None, itl_ms: float | None = None,
                     **settings: int) -> EngineConfig:
        """A profile's timing and KV capacity, with overrides; `settings`: block_size, max_running, ..."""
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; choose from {', '.join(PROFILES)}")
        p = PROFILES[profile]
        capacity = p.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens
        return cls(timing=p.timing.with_overrides(prefill_tokens_per_s, itl_ms),
                   kv_capacity_tokens=capacity, **settings)

    @property
    def capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size


@dataclass(slots=True)
class StepResult:
    duration: float = 0.0  # seconds of modelled time
    steps: int = 0  # scheduler steps taken (more than 1 only for fused decode)
    first_tokens: dict[SeqId, int] = field(default_factory=dict)  # seq -> its cached prompt tokens
    tokens: dict[SeqId, int] = field(default_factory=dict)  # seq -> tokens generated (first included)
    finished: list[SeqId] = field(default_factory=list)
    loads: dict[SeqId, int] = field(default_factory=dict)  # remote seq admitted -> prompt tokens to load


@dataclass(slots=True)
class EngineStats:
    requests_submitted: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which cached
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_failed: int = 0  # remote sequences whose KV never arrived (and were not recomputed)
    external_queries: int = 0  # prompt tokens past the local prefix hit (vLLM asks its KV connector for them)
    external_hits: int = 0  # of which loaded from another instance
    computed_tokens: int = 0  # prompt tokens to be computed here (neither cached nor loaded)


@dataclass(eq=False, slots=True)
class _Seq:
    seq_id: SeqId
    blocks: Sequence[Hashable]  # hashes of the prompt's full blocks
    prompt_tokens: int
    max_tokens: int
    need_blocks: int  # blocks for prompt and output together
    cached_tokens: int = 0
    computed: int = 0  # prompt tokens in the KV cache (cached + prefilled)
    generated: int = 0  # > 0 once prefill is complete
    kv: list[KVBlock] = field(default_factory=list)  # its blocks in the pool, in token order, once admitted
    hashed: int = 0  # leading blocks of `kv` that hold a cached (hashed) prompt block
    token_ids: Sequence[int] = ()  # the prompt's ids, kept only where KV events are published (their token_ids)
    remote: bool = False  # its prompt's KV past the local prefix hit is loaded from another instance
    hold: bool = False  # keep its prompt's blocks when it finishes, for another instance to read
    cache: bool = True  # use and feed the prefix cache (SGLang's decode instances do not)


class KvEventSink(Protocol):
    """Where the model reports the blocks it caches and evicts (engine/kv_events.py publishes them as vLLM does)."""

    def stored(self, block_hashes: list[int], parent_hash: int | None, token_ids: list[int], block_size: int,
               lora_name: str | None = None) -> None: ...

    def removed(self, block_hashes: list[int]) -> None: ...


def external_hash(block_hash: Hashable) -> int:
    """A block hash as vLLM's events carry it: an int as it is, a digest by its low 64 bits."""
    return block_hash if isinstance(block_hash, int) else int.from_bytes(bytes(block_hash)[-8:], "big")


class EngineModel:
    def __init__(self, config: EngineConfig, events: KvEventSink | None = None) -> None:
        self.config = config
        self.events = events
        self.pool = BlockPool(config.capacity_blocks, None if events is None else self._evicted)
        self.stats = EngineStats()
        # dicts keep insertion order: FIFO for waiting, admission order for running
        self._waiting: dict[SeqId, _Seq] = {}
        self._running: dict[SeqId, _Seq] = {}
        self._loading: dict[SeqId, _Seq] = {}  # admitted remote sequences waiting for their KV
        self._held: dict[SeqId, list[KVBlock]] = {}  # finished hold sequences' prompt blocks

    # -- requests ------------------------------------------------------------------------------------------
    def submit(self, seq_id: SeqId, blocks: Sequence[Hashable], prompt_tokens: int, max_tokens: int,
               token_ids: Sequence[int] = (), *, remote: bool = False, hold: bool = False,
               cache: bool = True) -> None:
        """Queue a sequence (`token_ids`: its prompt, for the KV events; `remote`, `hold`, `cache`: see _Seq).
        ValueError if its id is in use or it could not fit even in an empty cache."""
        if any(seq_id in d for d in (self._waiting, self._running, self._loading, self._held)):
            raise ValueError(f"sequence {seq_id!r} is already in the engine")
        need = self.check(blocks, prompt_tokens, max_tokens)
        self._waiting[seq_id] = _Seq(seq_id, blocks, prompt_tokens, max_tokens, need,
                                     token_ids=token_ids if self.events is not None else (),
                                     remote=remote, hold=hold, cache=cache)
        self.stats.requests_submitted += 1

    def check(self, blocks: Sequence[Hashable], prompt_tokens: int, max_tokens: int) -> int:
        """ValueError if such a sequence could never run here; else the KV blocks it needs."""
        bs = self.config.block_size
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be at least 1")
        if len(blocks) > prompt_tokens // bs:
            raise ValueError("more prompt blocks than full blocks of prompt tokens")
        need = -(-(prompt_tokens + max_tokens) // bs)
        if need > self.config.capacity_blocks:
            raise ValueError(f"prompt and max_tokens need {need * bs} tokens of KV cache; "
                             f"the engine holds {self.config.capacity_blocks * bs}")
        return need

    def cancel(self, seq_id: SeqId) -> bool:
        """Drop a sequence wherever it is; its computed blocks stay cached. False if unknown (or done)."""
        if self._waiting.pop(seq_id, None) is None:
            s = self._running.pop(seq_id, None) or self._loading.pop(seq_id, None)
            if s is None:
                return False
            self._release(s)
        self.stats.requests_cancelled += 1
        return True

    def loaded(self, seq_id: SeqId) -> bool:
        """A remote sequence's KV arrived: its full blocks enter the prefix cache and it runs. False if unknown."""
        s = self._loading.pop(seq_id, None)
        if s is None:
            return False
        s.computed = s.prompt_tokens
        self._cache_computed(s)
        s.computed -= 1  # vLLM computes the last prompt token again to sample the next one
        s.cached_tokens = s.prompt_tokens  # vLLM's count: local hits and loaded tokens alike
        self._running[seq_id] = s
        return True

    def load_failed(self, seq_id: SeqId, recompute: bool) -> bool:
        """A remote sequence's KV did not arrive: it computes its prompt here (`recompute`) or ends, failed.
        False if unknown."""
        s = self._loading.pop(seq_id, None)
        if s is None:
            return False
        if recompute:
            self._running[seq_id] = s
        else:
            self._release(s)
            self.stats.requests_failed += 1
        return True

    def held_block_ids(self, seq_id: SeqId) -> list[int]:
        """The prompt blocks a finished hold sequence keeps ([] if none)."""
        return [b.block_id for b in self._held.get(seq_id, ())]

    def release(self, seq_id: SeqId) -> bool:
        """Free a finished hold sequence's blocks (they stay cached). False if it holds none."""
        blocks = self._held.pop(seq_id, None)
        if blocks is None:
            return False
        self.pool.free(reversed(blocks))
        return True

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting and not self._loading

    @property
    def stalled(self) -> bool:
        """Whether a step would do nothing: nothing runs and nothing can be admitted (it may still be loading)."""
        return not self._running and not self._head_admissible()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to be admitted or for their KV to arrive (vLLM counts both)."""
        return len(self._waiting) + len(self._loading)

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks in use by running sequences (cached, evictable blocks count as free, as in vLLM)."""
        return self.pool.usage

    @property
    def decode_step_seconds(self) -> float:
        """Duration of one pure-decode step with the current batch."""
        return self.config.timing.step_ms(0.0, False, len(self._running)) / 1000.0

    def fusible_decode_steps(self) -> int:
        """Pure-decode steps that can run before the batch changes: until the next sequence finishes.

        0 when the next step must prefill or admit (or nothing runs).
        """
        if not self._running or self._head_admissible():
            return 0
        steps = None
        for s in self._running.values():
            if not s.generated:
                return 0
            left = s.max_tokens - s.generated
            steps = left if steps is None or left < steps else steps
        return steps

    # -- advancing -----------------------------------------------------------------------------------------
    def step(self, max_decode_steps: int = 1) -> StepResult:
        """Run one scheduler step, or up to `max_decode_steps` fused pure-decode steps if that is all there is."""
        if max_decode_steps < 1:
            raise ValueError("max_decode_steps must be at least 1")
        if max_decode_steps == 1:  # the general step does the same as one fused step, without the check
            return self._schedule()
        fused = min(max_decode_steps, self.fusible_decode_steps())
        return self._decode(fused) if fused else self._schedule()

    def _decode(self, k: int) -> StepResult:
        result = StepResult(duration=k * self.decode_step_seconds, steps=k)
        self._generate(list(self._running.values()), k, result)
        return result

    def _schedule(self) -> StepResult:
        if self.idle:
            return StepResult()
        cfg = self.config
        decoding = [s for s in self._running.values() if s.generated]
        budget = cfg.max_batched_tokens - len(decoding)
        chunks: list[tuple[_Seq, int]] = []
        loads: dict[SeqId, int] = {}
        for s in self._running.values():
            if not s.generated and budget > 0:
                e = min(s.prompt_tokens - s.computed, budget)
                chunks.append((s, e))
                budget -= e
        while self._waiting and budget > 0 and len(self._running) < cfg.max_running:
            s = next(iter(self._waiting.values()))
            if not self._admit(s):
                break  # first come first served: the head waits for room, and so does everyone behind it
            if s.remote:
                loads[s.seq_id] = s.prompt_tokens - s.computed
                continue
            e = min(s.prompt_tokens - s.computed, budget)
            chunks.append((s, e))
            budget -= e

        prefill_ms = sum(cfg.timing.prefill_ms(e, s.computed + e) for s, e in chunks)
        result = StepResult(duration=cfg.timing.step_ms(prefill_ms, bool(chunks), len(decoding)) / 1000.0,
                            steps=1, loads=loads)
        self._generate(decoding, 1, result)
        prefilled = []
        for s, e in chunks:
            s.computed += e
            self._cache_computed(s)
            if s.computed == s.prompt_tokens:
                result.first_tokens[s.seq_id] = s.cached_tokens
                prefilled.append(s)
        self._generate(prefilled, 1, result)
        return result

    # -- internals -----------------------------------------------------------------------------------------
    def _hits(self, s: _Seq) -> list[KVBlock]:
        """The cached blocks `s` would start from: at most (prompt_tokens - 1) // block_size (vLLM recomputes
        the last prompt token to get its logits)."""
        if not s.cache:
            return []
        return self.pool.cached_prefix(s.blocks, (s.prompt_tokens - 1) // self.config.block_size)

    def _head_admissible(self) -> bool:
        if not self._waiting or len(self._running) >= self.config.max_running:
            return False
        s = next(iter(self._waiting.values()))
        hits = self._hits(s)
        return self.pool.can_allocate(hits, s.need_blocks - len(hits))

    def _admit(self, s: _Seq) -> bool:
        hits = self._hits(s)
        pool = self.pool
        if not pool.can_allocate(hits, s.need_blocks - len(hits)):
            return False
        pool.take(hits)
        s.kv = hits + pool.allocate(s.need_blocks - len(hits))
        s.hashed = len(hits)
        s.cached_tokens = s.computed = len(hits) * self.config.block_size
        del self._waiting[s.seq_id]
        (self._loading if s.remote else self._running)[s.seq_id] = s
        self._count_admitted(s)
        return True

    def _count_admitted(self, s: _Seq) -> None:
        """Prompt tokens by source, counted once, at admission (as vLLM does)."""
        stats = self.stats
        if s.cache:
            stats.prefix_queries += s.prompt_tokens
            stats.prefix_hits += s.cached_tokens
        stats.prompt_tokens += s.prompt_tokens
        rest = s.prompt_tokens - s.cached_tokens
        stats.external_queries += rest
        if s.remote:
            stats.external_hits += rest
        else:
            stats.computed_tokens += rest

    def _cache_computed(self, s: _Seq) -> None:
        """Newly computed full prompt blocks enter the prefix cache under their hashes."""
        if not s.cache:
            return
        full = min(len(s.blocks), s.computed // self.config.block_size)
        start = s.hashed
        for i in range(start, full):
            self.pool.cache(s.kv[i], s.blocks[i])
            s.hashed = i + 1
        if self.events is not None and full > start and len(s.token_ids) >= full * self.config.block_size:
            size = self.config.block_size
            self.events.stored([external_hash(h) for h in s.blocks[start:full]],
                               external_hash(s.blocks[start - 1]) if start else None,
                               list(s.token_ids[start * size:full * size]), size)

    def _evicted(self, block_hash: Hashable) -> None:
        assert self.events is not None
        self.events.removed([external_hash(block_hash)])

    def _generate(self, seqs: list[_Seq], k: int, result: StepResult) -> None:
        """Give each sequence k more tokens; finish those that reach max_tokens. (The hot loop.)"""
        tokens = result.tokens
        for s in seqs:
            s.generated += k
            tokens[s.seq_id] = k
            if s.generated >= s.max_tokens:
                self._finish(s, result)
        self.stats.generation_tokens += k * len(seqs)

    def _finish(self, s: _Seq, result: StepResult) -> None:
        del self._running[s.seq_id]
        if s.hold:
            self._hold(s)
        else:
            self._release(s)
        self.stats.requests_finished += 1
        result.finished.append(s.seq_id)

    def _release(self, s: _Seq) -> None:
        self.pool.free(reversed(s.kv))  # tail first: the prompt's head blocks stay cached longest
        s.kv = []

    def _hold(self, s: _Seq) -> None:
        """Keep the blocks that hold the prompt's KV (vLLM's remote_block_ids); free those reserved for output."""
        keep = -(-s.prompt_tokens // self.config.block_size)
        self.pool.free(reversed(s.kv[keep:]))
        self._held[s.seq_id] = s.kv[:keep]
        s.kv = []
