"""One request's life in the router, as states, and the books it opens and closes on the way.

received -> keyed -> admitted (or waiting -> admitted) -> dispatched -> first_token -> finished, with refused and
cancelled as the other ends; a failure before the first token may go back to admitted (a retry elsewhere). Each
`Leg` is the request's stay at one instance: it opens the fleet's and the admission's books when sent and closes
each exactly once, whichever way the request ends. A disaggregated request has two legs (core/disaggregation.py):
a prefill leg handed over to a decode leg (`handover`), or both sent at once (`alongside`). A leg may be held
between being sent and reaching its engine while another request there computes the prefix they share
(`prefill_leader`, core/prefills.py); it counts at its instance meanwhile. An event the current state does not allow
raises `OutOfOrder` and changes nothing. Pure: no I/O and no clock of its own (the shell passes one); the shell's side
effects (metrics, other replicas, waking the queue) hang on `Hooks`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

from warmroute.core.admission import Admission, Waiter
from warmroute.core.feedback import Verdict
from warmroute.core.fleet import Fleet
from warmroute.core.routing_key import RoutingKey
from warmroute.core.strategies import Decision


class State(enum.Enum):
    RECEIVED = "received"
    KEYED = "keyed"
    WAITING = "waiting"  # in the admission queue, or given a slot there and not yet taken it
    ADMITTED = "admitted"
    DISPATCHED = "dispatched"
    FIRST_TOKEN = "first_token"
    FINISHED = "finished"  # answered, failed or cut off: every leg closed
    REFUSED = "refused"  # never sent: a bad request, no instance, or the queue turned it away
    CANCELLED = "cancelled"  # the client left before it was sent


ENDED = frozenset({State.FINISHED, State.REFUSED, State.CANCELLED})


class OutOfOrder(RuntimeError):
    """An event the request's state does not allow (a second dispatch, a first token before any dispatch, ...)."""


class Hooks:
    """What the shell does on each step of a leg; every method does nothing unless overridden."""

    def dispatched(self, life: Lifecycle, leg: Leg) -> None:
        pass

    def recorded(self, life: Lifecycle, leg: Leg) -> None:
        """The leg's chain went into the prefix index."""

    def first_token(self, life: Lifecycle, leg: Leg, seconds: float) -> None:
        pass

    def finished(self, life: Lifecycle, leg: Leg, seconds: float) -> None:
        pass


NO_HOOKS = Hooks()


class Leg:
    """The request's stay at one instance, from being sent there to its end there."""

    __slots__ = ("decision", "instance", "role", "uncached_tokens", "kv_tokens", "blocks", "queued_ahead",
                 "prefill_ahead", "sent_at", "held_s", "leads", "got_first", "done", "recorded", "fed_back")

    def __init__(self, decision: Decision, blocks: Sequence[int] | None, sent_at: float, role: str = "",
                 leads: bool = True) -> None:
        self.decision = decision
        self.instance = decision.instance
        self.role = role  # "prefill" or "decode" for a leg of a disaggregated request; "" for a whole one
        # the prompt it computes there: none on a decode leg, whose KV cache comes from its prefill leg
        self.uncached_tokens = 0 if role == "decode" else decision.uncached_tokens
        self.kv_tokens = decision.kv_tokens  # the KV cache it needs there
        self.blocks = blocks  # its chain, where the strategy keeps a prefix index
        self.queued_ahead = 0  # requests sent there before it still waiting for their first token
        self.prefill_ahead = 0.0  # the prefill the instance does before this one's first token, its own included
        self.sent_at = sent_at  # when it went to its engine (after any hold for another's prefill)
        self.held_s = 0.0  # how long it was held for another request's prefill of its prefix (`resumed`)
        # Whether its first token marks the end of its prefill, so others may wait for it (a streamed answer, a
        # prefill leg's one token); never a decode leg, which computes no prompt.
        self.leads = leads and role != "decode"
        self.got_first = self.done = self.recorded = self.fed_back = False


class Lifecycle:
    """One request: its state, its key, tenant and priority, its place in the admission queue and its legs."""

    __slots__ = ("fleet", "admission", "clock", "hooks", "records_prefixes", "state", "key", "tenant", "priority",
                 "waiter", "legs", "shell")

    def __init__(self, fleet: Fleet, admission: Admission, clock: Callable[[], float], *,
                 records_prefixes: bool = True, hooks: Hooks = NO_HOOKS) -> None:
        self.fleet, self.admission, self.clock, self.hooks = fleet, admission, clock, hooks
        self.records_prefixes = records_prefixes  # whether the strategy keeps a prefix index (legs record chains)
        self.state = State.RECEIVED
        self.key: RoutingKey | None = None
        self.tenant = ""
        self.priority = 0
        self.waiter: Waiter | None = None
        self.legs: list[Leg] = []
        self.shell: Any = None  # the shell's own data on this request (a future to wake, the workload's request)

    def __repr__(self) -> str:
        return f"<Lifecycle {self.state.value} {self.tenant!r} legs={len(self.legs)}>"

    @property
    def leg(self) -> Leg | None:
        """The latest leg (the one that answers while dispatched)."""
        return self.legs[-1] if self.legs else None

    def leg_at(self, role: str) -> Leg | None:
        """The latest leg of `role` ("prefill", "decode")."""
        return next((leg for leg in reversed(self.legs) if leg.role == role), None)

    def _expect(self, event: str, *states: State) -> None:
        if self.state not in states:
            raise OutOfOrder(f"request {event} while {self.state.value}")

    # -- before it is sent ---------------------------------------------------------------------------------
    def keyed(self, key: RoutingKey | None, tenant: str = "", priority: int = 0) -> None:
        """Its routing key is known (None for a path that carries no prompt), and who sends it."""
        self._expect("keyed", State.RECEIVED)
        self.key, self.tenant, self.priority, self.state = key, tenant, priority, State.KEYED

    def admit(self, decision: Decision, now: float, size_bytes: int = 0, queue: bool = True,
              pool: str = "") -> list[Waiter]:
        """Admitted at once where `decision`'s instance has room (or `queue` is off); else waiting in the queue
        (`waiter`, whose payload is this lifecycle). Returns the waiters it pushed out of the queue (their own
        lifecycles are to be `shed`); raises QueueFull, refused, when there is no place for it."""
        self._expect("admitted", State.KEYED)
        adm = self.admission
        waiter = adm.waiter_for(decision, now, self.priority, self.tenant, size_bytes,
                                self.key.model if self.key is not None else None, pool) if queue else None
        if waiter is None:
            self.state = State.ADMITTED
            return []
        waiter.payload, self.waiter = self, waiter
        try:
            preempted = adm.offer(waiter)
        except BaseException:
            self.state = State.REFUSED
            raise
        self.state = State.WAITING
        return preempted

    def assigned(self) -> None:
        """The queue gave it a slot (waiter.instance): the slot is the shell's to send it with now."""
        self._expect("assigned", State.WAITING)
        if self.waiter is None or self.waiter.instance is None:
            raise OutOfOrder("request assigned while the queue gave it no instance")
        self.admission.dispatched(self.waiter)
        self.state = State.ADMITTED

    def shed(self) -> None:
        """The queue turned it away (waiter.shed: deadline, preempted, no instance); it holds nothing there."""
        self._expect("shed", State.WAITING)
        if self.waiter is None or self.waiter.shed is None:
            raise OutOfOrder("request shed while the queue still holds it")
        self.state = State.REFUSED

    def refuse(self) -> None:
        """Answered without being sent (a bad request, no instance to send it to)."""
        self._expect("refused", State.RECEIVED, State.KEYED)
        self.state = State.REFUSED

    # -- at an instance ------------------------------------------------------------------------------------
    def dispatch(self, decision: Decision, record: bool = True, role: str = "", alongside: bool = False,
                 leads: bool = True) -> Leg:
        """Sent to `decision`'s instance: a leg opens its books there. Its chain goes into the index now, or
        (`record` off) when the shell calls `record`, once the request is on its way. `role`: the leg's part in a
        disaggregated request; `alongside`: a second leg sent while the first is still open (the decode leg of a
        request whose legs go at once), which then answers; `leads`: its first token will mark the end of its
        prefill (see Leg.leads)."""
        if alongside:
            self._expect("dispatched alongside", State.DISPATCHED)
            if len(self.open_legs()) != 1:
                raise OutOfOrder("request dispatched alongside with no single open leg")
        else:
            self._expect("dispatched", State.ADMITTED)
        fleet = self.fleet
        leg = Leg(decision, decision.blocks if self.records_prefixes else None, self.clock(), role, leads)
        inst = fleet.instances.get(leg.instance)
        leg.prefill_ahead = leg.uncached_tokens + (inst.queued_prefill_tokens if inst is not None else 0.0)
        leg.queued_ahead = fleet.dispatched(leg.instance, leg.uncached_tokens, prompt_tokens=leg.kv_tokens)
        self.admission.started(self.tenant, leg.instance, leg.uncached_tokens)
        self.legs.append(leg)
        self.state = State.DISPATCHED
        if record:
            self.record(leg)
        self.hooks.dispatched(self, leg)
        return leg

    def record(self, leg: Leg) -> None:
        """The leg's chain into the index (it is, or is about to be, cached there), once; not for a leg that
        ended before its first token, which never arrived."""
        if leg.recorded or not leg.blocks or (leg.done and not leg.got_first):
            return
        leg.recorded = True
        self.fleet.index.record(leg.instance, leg.blocks)  # an instance removed meanwhile: a no-op
        if leg.leads and not leg.got_first:
            self.fleet.prefills.started(leg, leg.decision.depth)
        self.hooks.recorded(self, leg)

    def prefill_leader(self, leg: Leg) -> Leg | None:
        """The leg of another request at `leg`'s instance still computing the prefix `leg` is predicted to find
        cached there (core/prefills.py): the shell may hold `leg` until that one's first token or end, then send it
        (`resumed`). None where nothing is being computed for it, or for a decode leg."""
        if not leg.blocks or leg.role == "decode" or leg.got_first or leg.done:
            return None
        return self.fleet.prefills.leader(leg, leg.decision.depth)  # type: ignore[return-value]

    def resumed(self, leg: Leg) -> None:
        """Held for another request's prefill (`prefill_leader`), `leg` goes to its engine now: its time to first
        token counts from here, as the engine sees it."""
        now = self.clock()
        leg.held_s += now - leg.sent_at
        leg.sent_at = now

    def first_token(self) -> Leg:
        """Its first token came: its prefill no longer queues ahead of others there."""
        self._expect("first token", State.DISPATCHED)
        leg = self.legs[-1]
        self.state = State.FIRST_TOKEN
        self._first(leg)
        return leg

    def _first(self, leg: Leg) -> None:
        leg.got_first = True
        if leg.recorded and leg.leads:
            self.fleet.prefills.ended(leg)
        seconds = self.clock() - leg.sent_at
        self.fleet.first_token(leg.instance, leg.uncached_tokens, seconds)
        self.admission.first_token(self.tenant, leg.instance, leg.uncached_tokens)
        self.hooks.first_token(self, leg, seconds)

    def feedback(self, cached_tokens: int, engine_prompt_tokens: int | None = None,
                 prompt_tokens: int | None = None) -> Verdict | None:
        """The engine said how many of its prompt tokens it had cached: the index is corrected (once per leg).
        None where there is no chain to judge."""
        self._expect("feedback", State.FIRST_TOKEN)
        leg = self.legs[-1]
        if leg.fed_back:
            raise OutOfOrder("request feedback twice from one instance")
        leg.fed_back = True
        if not leg.blocks:
            return None
        return self.fleet.feedback(leg.instance, leg.blocks, leg.decision.matched_tokens, cached_tokens,
                                   engine_prompt_tokens, prompt_tokens, leg.queued_ahead)

    def open_legs(self) -> list[Leg]:
        return [leg for leg in self.legs if not leg.done]

    def retry(self) -> Leg:
        """It failed at its instance before a first token: its open legs close, and it may be sent again."""
        self._expect("retry", State.DISPATCHED)
        for leg in self.open_legs()[:-1]:
            self._close_leg(leg)
        leg = self._close_leg(self.legs[-1])
        self.state = State.ADMITTED
        return leg

    def handover(self) -> Leg:
        """Its prefill leg answered: that leg closes (its prefix stays cached there), and the decode leg may go."""
        self._expect("handed over", State.FIRST_TOKEN)
        leg = self.legs[-1]
        if leg.role != "prefill":
            raise OutOfOrder("request handed over from a leg that is not a prefill leg")
        self._close_leg(leg)
        self.state = State.ADMITTED
        return leg

    def leg_finished(self, leg: Leg, answered: bool) -> None:
        """A leg that does not answer the client (the prefill leg sent alongside) ended, `answered` by its engine
        or not; the request goes on."""
        if leg.done or leg is self.legs[-1]:
            raise OutOfOrder("request leg finished twice, or the answering leg finished alone")
        if answered:
            self._first(leg)
        self._close_leg(leg)

    def finish(self) -> None:
        """Done: answered, failed, or given up after a retry found nowhere to go."""
        self._expect("finished", State.DISPATCHED, State.FIRST_TOKEN, State.ADMITTED)
        self._end(State.FINISHED)

    def cancel(self) -> None:
        """The client left (or the shell gave up): out of the queue (or its slot there back), or its open leg
        closed; finished if it was ever sent, else cancelled."""
        self._expect("cancelled", State.RECEIVED, State.KEYED, State.WAITING, State.ADMITTED, State.DISPATCHED,
                     State.FIRST_TOKEN)
        self._end(State.FINISHED if self.legs else State.CANCELLED)

    def close(self) -> None:
        """Whatever happened, nothing stays open (for a shell's `finally`); a request already ended is left as is."""
        if self.state not in ENDED:
            self.cancel()

    def _end(self, state: State) -> None:
        if self.state in (State.DISPATCHED, State.FIRST_TOKEN):
            for leg in self.open_legs():
                self._close_leg(leg)
        elif self.state in (State.WAITING, State.ADMITTED) and self.waiter is not None:
            self.admission.cancel(self.waiter)  # out of the queue, or a slot it was given and never used back
        self.state = state

    def _close_leg(self, leg: Leg) -> Leg:
        leg.done = True
        if leg.recorded and leg.leads and not leg.got_first:
            self.fleet.prefills.ended(leg)
        seconds = self.clock() - leg.sent_at
        self.fleet.finished(leg.instance, leg.uncached_tokens, leg.got_first, leg.blocks, leg.kv_tokens, seconds)
        self.admission.ended(self.tenant, leg.instance, leg.got_first, leg.uncached_tokens)
        self.hooks.finished(self, leg, seconds)
        return leg
