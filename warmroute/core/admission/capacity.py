"""Who has room: how many requests each instance's engine runs at once (`limit`), how many more it takes now
(`spare`, counting the slots reserved for waiters the queue assigned there), whether a request fits there with its
KV demand (`fits`), the fleet's free slots in all (`fleet_spare`), and how long a request arriving now would wait
in the router for a slot (`slot_wait`). An instance whose limit is unknown always has room."""

from __future__ import annotations

import math
from typing import Any

from warmroute.core.admission.settings import AdmissionSettings
from warmroute.core.engine_capacity import MIN_BATCH
from warmroute.core.fleet import Fleet, Instance
from warmroute.core.strategies import kv_pressure

# The least a learned engine limit holds requests at (one learned where the KV cache filled may be lower): an engine
# queueing with fewer running is busy with long prompts (each step's token budget), not out of batch slots, and
# holding requests in the router below it costs throughput.
MIN_LEARNED_LIMIT = MIN_BATCH
UNBOUNDED = 1 << 30  # the room of an instance whose capacity is unknown: the router never holds requests for it


def count_down(counts: dict[Any, int], key: Any) -> None:
    """One fewer of `key` in `counts`, dropping the key at none."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


class Capacity:
    """The room at each instance, with the slots reserved there and the requests waiting for it."""

    def __init__(self, settings: AdmissionSettings, fleet: Fleet) -> None:
        self.settings = settings
        self.fleet = fleet
        self.reserved: dict[str, int] = {}  # slots given to assigned waiters not yet dispatched, per instance
        self.pinned: dict[str, int] = {}  # per instance: requests waiting for it (Waiter.pin)

    def reserve(self, name: str) -> None:
        self.reserved[name] = self.reserved.get(name, 0) + 1

    def release(self, name: str) -> None:
        count_down(self.reserved, name)

    def pin(self, name: str) -> None:
        self.pinned[name] = self.pinned.get(name, 0) + 1

    def unpin(self, name: str) -> None:
        count_down(self.pinned, name)

    def limit(self, inst: Instance) -> int | None:
        """Requests `inst`'s engine runs at once: the operator's figure, else what it was seen running when it
        queued plus engine_queue_share of that (none where its KV cache was full: a queued request's blocks would
        evict the prefixes of those to come), but never below MIN_LEARNED_LIMIT (an engine queueing with fewer
        running is busy computing long prefills, not out of batch slots: holding requests for it would only delay
        them); None while unknown."""
        cap = inst.capacity
        if cap.stated is not None or cap.learned is None:
            return cap.stated
        share = 0.0 if cap.kv_bound else self.settings.engine_queue_share
        return max(math.ceil(cap.learned * (1 + share)), MIN_LEARNED_LIMIT)

    def spare(self, inst: Instance) -> int:
        """Requests `inst`'s engine takes before it is full: its limit less what is in flight there (other routers'
        too, where it reports them) and the slots reserved for waiters; UNBOUNDED where the limit is unknown."""
        limit = self.limit(inst)
        if limit is None:
            return UNBOUNDED
        return limit - int(inst.load) - self.reserved.get(inst.name, 0)

    def slot_wait(self, inst: Instance) -> float:
        """Seconds a request arriving now would wait in the router for a slot at `inst` (0 while its engine has
        room beyond what the requests already waiting for it will take): its place in that line, over the rate
        at which the engine frees slots (its limit per mean request duration). What cache_aware's slot_wait
        scorer adds to that instance's estimated time to first token."""
        ahead = self.pinned.get(inst.name, 0) - self.spare(inst)
        if ahead < 0:
            return 0.0
        limit = self.limit(inst) or 1
        return (ahead + 1) * self.fleet.mean_service_s / limit

    def has_room(self, inst: Instance, kv_tokens: int, strict_kv: bool = True) -> bool:
        """Under its engine's capacity (counting reserved slots), with the fleet's total under the sum of the
        capacities (`fleet_spare`), and, if `strict_kv`, under the KV limit with this request's `kv_tokens`
        (unless nothing is in flight there: an idle instance takes anything)."""
        return self.fleet_spare() > 0 and self.fits(inst, kv_tokens, strict_kv)

    def fits(self, inst: Instance, kv_tokens: int, strict_kv: bool, lent: int = 0) -> bool:
        """has_room at one instance, `lent` slots past its capacity."""
        if not (inst.healthy and not inst.draining) or self.spare(inst) + lent <= 0:
            return False
        if not strict_kv or not inst.inflight or inst.kv_capacity_tokens <= 0:
            return True
        scale = self.fleet.cache_scale.value
        return kv_pressure(inst, scale) + kv_tokens / (inst.kv_capacity_tokens * scale) <= self.settings.hold_kv_limit

    def fleet_spare(self) -> int:
        """Free slots over the routable instances: fewer than theirs added up while an instance serves past its
        capacity on a slot lent to a tenant behind its share (placement's `best_for`), so the fleet's total stays
        bounded."""
        return sum(self.spare(i) for i in self.fleet.routable())

    def ample_room(self, inst: Instance) -> bool:
        """Whether `inst` has spill_headroom x its capacity free, so that any waiter may move there; an instance of
        unknown capacity only when idle (its room is not known to be ample, only not known to be short)."""
        if self.limit(inst) is None:
            return inst.load == 0 and not self.reserved.get(inst.name)
        return self.spare(inst) >= max(1, self.share_of_capacity(inst, self.settings.spill_headroom))

    def share_of_capacity(self, inst: Instance, share: float) -> int:
        """`share` x the requests `inst`'s engine runs at once (0 where that is unknown)."""
        limit = self.limit(inst)
        return math.ceil(share * limit) if limit is not None else 0
