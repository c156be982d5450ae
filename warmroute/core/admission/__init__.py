"""Admission control: which requests go to an instance now, which wait in the router, and who goes next.

A request waits here only when the engine chosen for it is full (`Instance.capacity` requests in flight, or with
`hold_kv_limit` set, its KV demand over that share of the cache), keeping its place and its prefix instead of queueing in
the engine. When an instance has room, `pump` gives it the waiter of highest priority, then of the tenant furthest
behind its fair share, then the one losing least of its cached match there. The queue is bounded and every waiter
has a deadline; the shell answers those refused with 429. Pure: the router (asyncio) and the simulator (virtual
time) drive the same object with their own clocks. The rules in full, and why: docs/architecture.md, "Admission".

  settings   AdmissionConfig (the knobs), AdmissionSettings, and admission_settings (from the strategy's settings)
  waiter     Waiter, and why a request waits (WAIT_REASONS) or is refused (SHED_REASONS)
  capacity   who has room (Capacity: limit, spare, fits, fleet_spare, slot_wait)
  fairness   tenants' virtual time, shares and caps (Tenants)
  waitlist   the waiters, indexed in groups alike, by deadline and by tenant (WaitList)
  placement  which waiter a freed slot takes (Placement.best_for), and decide_at
  queue      the queue the shells drive (Admission, QueueFull)
"""

from warmroute.core.admission.capacity import MIN_LEARNED_LIMIT, UNBOUNDED, Capacity
from warmroute.core.admission.fairness import ARRIVALS_WINDOW, MAX_TENANTS_TRACKED, SHARE_TOLERANCE, Tenants
from warmroute.core.admission.placement import Placement, decide_at, gain, uncached_at
from warmroute.core.admission.queue import Admission, QueueFull
from warmroute.core.admission.settings import AdmissionConfig, AdmissionSettings, admission_settings
from warmroute.core.admission.waiter import (BUSY, DEADLINE, IMMEDIATE, KV, NO_INSTANCE, PREEMPTED, PREFILL, QUEUE_FULL,
                                             SHARE, SHED_REASONS, WAIT_REASONS, Waiter)

__all__ = ["ARRIVALS_WINDOW", "BUSY", "DEADLINE", "IMMEDIATE", "KV", "MAX_TENANTS_TRACKED",
           "MIN_LEARNED_LIMIT", "NO_INSTANCE", "PREEMPTED", "PREFILL", "QUEUE_FULL", "SHARE", "SHARE_TOLERANCE",
           "SHED_REASONS", "UNBOUNDED", "WAIT_REASONS", "Admission", "AdmissionConfig", "AdmissionSettings", "Capacity", "Placement",
           "QueueFull", "Tenants", "Waiter", "admission_settings", "decide_at", "gain", "uncached_at"]
