"""A fleet whose engines are all full, with a given number of requests waiting in the router's admission queue:
what the test and the benchmark of placement's work per freed slot start from (pure: no I/O)."""

from __future__ import annotations

import random

from warmroute.core.admission import Admission, AdmissionSettings
from warmroute.core.fleet import Fleet, FleetSettings
from warmroute.core.routing_key import key_for_json
from warmroute.core.strategies import Decision

INSTANCES, SLOTS, PROMPTS = 8, 64, 40


def full_queue(waiting: int, tenants: int = 1, seed: int = 0) -> Admission:
    """INSTANCES instances of SLOTS slots, all taken, each holding PROMPTS / INSTANCES of the prompts; `waiting`
    requests queued for them, spread over `tenants` tenants, each asking for a random prompt where it is cached."""
    fleet = Fleet(FleetSettings())
    names = [f"i{i}" for i in range(INSTANCES)]
    for name in names:
        fleet.add(name, 200_000)
        fleet.instances[name].capacity.stated = SLOTS
        fleet.instances[name].inflight = SLOTS
    adm = Admission(AdmissionSettings(concurrency_threshold=SLOTS, timeout_s=600, max_requests=max(4096, waiting)),
                    fleet)
    keys = [key_for_json("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": f"system prompt {j} " * 40}, {"role": "user", "content": "question"}]})
        for j in range(PROMPTS)]
    for j, k in enumerate(keys):
        fleet.index.record(names[j % INSTANCES], k.blocks())
    rng = random.Random(seed)
    for i in range(waiting):
        j = rng.randrange(PROMPTS)
        decision = Decision(names[j % INSTANCES], "cache_hit", keys[j].tokens, 100, keys[j].blocks(), False)
        waiter = adm.waiter_for(decision, i * 0.001, 0, f"t{i % tenants}", 1000)
        assert waiter is not None
        adm.offer(waiter)
    return adm


def free_slots(adm: Admission, slots: int, start: float) -> int:
    """Frees one slot at a time, instance after instance, and pumps the queue after each (a second apart), as the
    router does when a request finishes; what the queue assigns takes its slot at once. Returns the requests
    assigned."""
    names = sorted(adm.fleet.instances)
    taken = 0
    for i in range(slots):
        adm.fleet.instances[names[i % len(names)]].inflight -= 1
        assigned, shed = adm.pump(start + i)
        assert not shed
        for w in assigned:  # there, or lent to the instance a tenant's waiter waits for
            assert w.instance is not None
            adm.fleet.instances[w.instance].inflight += 1
            adm.dispatched(w)
        taken += len(assigned)
    return taken
