"""The queue's waiters, kept so that placement need not walk them all on every freed slot: in arrival order
(`by_seq`), by deadline (`due`), by priority (`newest_below`), each one's place among its tenant's (`place`, for
virtual finish times), and in groups of waiters alike (`Group`: priority, tenant, the instance they wait for, model,
pool, why they wait). A group keeps its waiters ranked by what they keep of their cached match at their own instance,
and apart those that would lose nothing elsewhere; a lookup is a bisection or a walk of those few."""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from warmroute.core.admission.capacity import count_down
from warmroute.core.admission.waiter import Waiter

GroupKey = tuple[str, str | None, str | None, str, str]  # tenant, pin, model, pool, why


def home_gain(w: Waiter) -> int:
    """What `w` keeps at the instance it waits for, less its deepest match anywhere (placement's `gain` there); 0
    for a waiter pinned nowhere (it has no prefix: nothing to lose anywhere)."""
    if w.pin is None:
        return 0
    return w.depths.get(w.pin, 0) - max(w.depths.values(), default=0)


def away_loss(w: Waiter) -> int:
    """What `w` loses at an instance holding none of its prompt, away from its own: its whole prompt, or its deepest
    match if deeper (placement's `gain` there, negated)."""
    return max(max(w.depths.values(), default=0), w.prompt_tokens)


@dataclass(eq=False, slots=True)
class Group:
    """Waiters alike in everything placement asks of them but their size, age and matches."""

    priority: int
    tenant: str
    pin: str | None
    model: str | None
    pool: str
    why: str
    by_seq: dict[int, Waiter] = field(default_factory=dict)  # arrival order
    # (-(home_gain - aging x enqueued), seq), ascending: the waiter gaining most at home (with aging) first
    ranked: list[tuple[float, int]] = field(default_factory=list)
    lossless: dict[int, Waiter] = field(default_factory=dict)  # those that lose nothing at any instance
    lossless_at: dict[str, dict[int, Waiter]] = field(default_factory=dict)  # per instance: those losing nothing there

    def oldest(self) -> Waiter:
        return next(iter(self.by_seq.values()))


class WaitList:
    """Every waiter of the queue, indexed; `add` and `remove` keep the indexes."""

    def __init__(self, aging_tokens_per_s: float) -> None:
        self.aging = aging_tokens_per_s
        self.by_seq: dict[int, Waiter] = {}  # arrival order
        self.groups: dict[int, dict[GroupKey, Group]] = {}  # by priority
        self.models: dict[str | None, int] = {}  # waiters per model asked for
        self._at_priority: dict[int, dict[int, Waiter]] = {}  # by priority, arrival order
        self._tenant_seqs: dict[str, list[int]] = {}  # per tenant, its waiters' seqs, ascending
        self._deadlines: list[tuple[float, int]] = []  # a heap; entries of waiters gone are dropped when met

    def rank_key(self, w: Waiter) -> tuple[float, int]:
        return -(home_gain(w) - self.aging * w.enqueued), w.seq

    def add(self, w: Waiter) -> None:
        self.by_seq[w.seq] = w
        key = (w.tenant, w.pin, w.model, w.pool, w.why)
        group = self.groups.setdefault(w.priority, {}).get(key)
        if group is None:
            group = self.groups[w.priority][key] = Group(w.priority, *key)
        group.by_seq[w.seq] = w
        bisect.insort(group.ranked, self.rank_key(w))
        loss = away_loss(w)
        if loss <= 0:
            group.lossless[w.seq] = w
        for name, depth in w.depths.items():
            if name != w.pin and depth >= loss:
                group.lossless_at.setdefault(name, {})[w.seq] = w
        self.models[w.model] = self.models.get(w.model, 0) + 1
        self._at_priority.setdefault(w.priority, {})[w.seq] = w
        bisect.insort(self._tenant_seqs.setdefault(w.tenant, []), w.seq)
        heapq.heappush(self._deadlines, (w.deadline, w.seq))

    def remove(self, w: Waiter) -> None:
        del self.by_seq[w.seq]
        key = (w.tenant, w.pin, w.model, w.pool, w.why)
        groups = self.groups[w.priority]
        group = groups[key]
        del group.by_seq[w.seq]
        ranked = group.ranked
        del ranked[bisect.bisect_left(ranked, self.rank_key(w))]
        group.lossless.pop(w.seq, None)
        for name in w.depths:
            at = group.lossless_at.get(name)
            if at is not None and at.pop(w.seq, None) is not None and not at:
                del group.lossless_at[name]
        if not group.by_seq:
            del groups[key]
            if not groups:
                del self.groups[w.priority]
        count_down(self.models, w.model)
        at_priority = self._at_priority[w.priority]
        del at_priority[w.seq]
        if not at_priority:
            del self._at_priority[w.priority]
        seqs = self._tenant_seqs[w.tenant]
        del seqs[bisect.bisect_left(seqs, w.seq)]
        if not seqs:
            del self._tenant_seqs[w.tenant]
        if len(self._deadlines) > 2 * len(self.by_seq) + 64:  # entries of waiters gone: drop them now and then
            self._deadlines = [(d, s) for d, s in self._deadlines if s in self.by_seq]
            heapq.heapify(self._deadlines)

    def place(self, w: Waiter) -> int:
        """`w`'s place among its tenant's waiters, in arrival order, from 1."""
        return bisect.bisect_left(self._tenant_seqs[w.tenant], w.seq) + 1

    def due(self, now: float) -> list[Waiter]:
        """The waiters whose deadline has come, earliest first, for the caller to `remove` (each is named once)."""
        out: list[Waiter] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, seq = heapq.heappop(heap)
            w = self.by_seq.get(seq)
            if w is not None and w.deadline <= now:
                out.append(w)
        return out

    def of_model(self, model: str | None) -> list[Waiter]:
        """The waiters asking for `model`, in no particular order."""
        return [w for groups in self.groups.values() for g in groups.values() if g.model == model
                for w in g.by_seq.values()]

    def newest_below(self, priority: int, taken: list[Waiter]) -> Waiter | None:
        """The newest waiter of the lowest priority below `priority`, not among `taken`."""
        for p in sorted(self._at_priority):
            if p >= priority:
                return None
            for w in reversed(self._at_priority[p].values()):
                if w not in taken:
                    return w
        return None

