"""How many requests an engine runs at once before it queues them: stated by the operator, or learned from the
load the engine reports; unknown means the router never holds a request back for that engine.

The router's queue exists for engines that are full: a request sent to one waits in the engine's own queue, holding
KV blocks, while its prefix may be evicted before its turn. Only the engine knows when it is full (its batch limit,
its free KV blocks), so the limit is learned from its scrapes:
  * until it reports requests waiting, or its KV cache held by running requests past KV_HIGH_WATER, on SUSTAINED
    scrapes in a row while its running batch does not grow, it has shown no limit: none is assumed. An engine
    whose batch grows while requests wait is admitting them as fast as it prefills (a burst of long prompts
    fills each step's token budget), not full;
  * its KV cache that full: its limit is what it runs now. More requests would evict the cached prefixes of the
    requests to come (vLLM and SGLang free a finished request's blocks to a cache that new ones evict), or wait;
  * requests waiting while it runs the most it was seen running over the last PEAK_WINDOW scrapes, and at least
    MIN_BATCH: its limit is that batch. A batch-bound engine refills its batch from its queue at once, so it runs
    at its peak whenever requests wait. One running fewer while requests wait spends each step's token budget on
    prefilling long prompts (a burst, a cold start): it has batch slots, and a limit learned there would hold
    its batch below what it serves (those scrapes are no evidence);
  * it runs more at once than its learned limit (requests sent before the limit was known, or a limit learned
    where two scrapes caught one long prefill step): the limit is that batch at once. An engine is never held
    below what it was seen running;
  * it reports neither on SUSTAINED scrapes in a row while the router kept it at its learned limit: the limit
    grows by GROWTH (at least one request), as the engine may have room it never got to show. An engine at its
    true batch size then queues the few requests past it for a scrape or two: the price of never holding requests
    an engine has room for.
The admission queue never holds a learned limit below a few requests (Admission.limit).
Scrape-driven and clock-free: the router calls `observe` per scrape, the simulator per simulated scrape.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

SUSTAINED = 2  # scrapes in a row that must agree before the limit moves: one scrape may catch a step in passing
MIN_BATCH = 32  # fewer running while requests wait is prefill, not a full batch (vLLM's smallest default is 128)
PEAK_WINDOW = 30  # scrapes over which the most requests running is the engine's batch
GROWTH = 1.125  # the limit's growth when the engine showed no queue at it
KV_HIGH_WATER = 0.9  # share of an engine's KV blocks held by running requests from which it counts as full


@dataclass(slots=True)
class EngineCapacity:
    stated: int | None = None  # the operator's figure (engine_capacity): never learned over
    learned: int | None = None
    kv_bound: bool = False  # the learned limit is where its KV cache filled (not its batch): nothing may queue past it
    _running: deque[int] = field(default_factory=lambda: deque(maxlen=PEAK_WINDOW))  # the last scrapes' batches
    _queued: int = 0  # scrapes in a row that reported requests waiting or a full KV cache, the batch not growing
    _clear: int = 0  # scrapes in a row at the learned limit that reported none waiting

    def observe(self, waiting: int | None, running: int | None, at_limit: bool,
                kv_usage: float | None = None) -> None:
        """One scrape of the engine; `at_limit`: the router had the learned limit's worth of requests there."""
        if self.stated is not None or waiting is None or running is None:
            return
        growing = bool(self._running) and running > self._running[-1]
        self._running.append(running)
        if self.learned is not None and running > self.learned:  # it runs that many at once: its batch holds them
            self.learned = running
        kv_full = kv_usage is not None and kv_usage >= KV_HIGH_WATER
        if (waiting > 0 or kv_full) and (growing or not (kv_full or self._batch_full(running))):
            self._queued = self._clear = 0
            return
        if waiting > 0 or kv_full:
            self._clear = 0
            self._queued += 1
            if self._queued >= SUSTAINED:
                self.learned = max(1, running)
                self.kv_bound = kv_full
            return
        self._queued = 0
        if self.learned is None or not at_limit:
            self._clear = 0
            return
        self._clear += 1
        if self._clear >= SUSTAINED:
            self.learned = max(self.learned + 1, math.ceil(self.learned * GROWTH))
            self._clear = 0

    def _batch_full(self, running: int) -> bool:
        """Whether requests waiting at `running` say the engine's batch is full (see the module's doc)."""
        return running >= MIN_BATCH and running >= max(self._running)
