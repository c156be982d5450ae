"""A request's lifecycle (core/lifecycle.py): each transition, events out of order refused, and the fleet's and the
admission queue's books closed exactly once on every path."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from warmroute.core.admission import DEADLINE, Admission, AdmissionSettings, QueueFull
from warmroute.core.lifecycle import ENDED, Hooks, Lifecycle, OutOfOrder, State
from warmroute.core.strategies import CACHE_HIT, COLD, Decision

from fleet_helpers import SYSTEM, fleet, key


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Counting(Hooks):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def dispatched(self, life, leg) -> None:
        self.calls.append(("dispatched", leg.instance))

    def recorded(self, life, leg) -> None:
        self.calls.append(("recorded", leg.instance))

    def first_token(self, life, leg, seconds) -> None:
        self.calls.append(("first_token", leg.instance))

    def finished(self, life, leg, seconds) -> None:
        self.calls.append(("finished", leg.instance))


def setup(n: int = 2, capacity: int | None = 4, **adm):
    f = fleet(n)
    for inst in f.instances.values():
        inst.capacity.stated = capacity
    threshold = capacity if capacity is not None else 64
    return f, Admission(AdmissionSettings(concurrency_threshold=threshold, **adm), f), Clock()


def decision(name: str, blocks=(11, 12, 13), matched: int = 16, prompt: int = 64) -> Decision:
    return Decision(name, CACHE_HIT if matched else COLD, matched, prompt, blocks)


def life_of(f, adm, clock, hooks: Hooks | None = None, tenant: str = "t", records: bool = True) -> Lifecycle:
    life = Lifecycle(f, adm, clock, records_prefixes=records, **({"hooks": hooks} if hooks else {}))
    life.keyed(key(SYSTEM), tenant)
    return life


class Sent:
    """Two instances with room, and a request of tenant t dispatched to the first (`life`, its `leg`)."""

    def __init__(self, hooks: Hooks | None = None, records: bool = True, record: bool = True) -> None:
        self.f, self.adm, self.clock = setup()
        self.a, self.b = sorted(self.f.instances)
        self.hooks = hooks
        self.life = life_of(self.f, self.adm, self.clock, hooks, records=records)
        self.life.admit(decision(self.a), 0.0)
        self.leg = self.life.dispatch(decision(self.a), record=record)

    def at_zero(self) -> bool:
        return at_zero(self.f, self.adm)


def books(f, adm) -> tuple:
    """Everything a request can leave open, as one comparable value."""
    per_instance = tuple((i.name, i.inflight, i.pending, i.inflight_prompt_tokens, i.queued_prefill_tokens)
                         for i in f.instances.values())
    return per_instance, dict(adm.waiters), dict(adm.reserved), adm.bytes, dict(adm.active_tenants), len(f.prefills)


def at_zero(f, adm) -> bool:
    return books(f, adm) == books(fleet(len(f.instances)), Admission(AdmissionSettings(), fleet(len(f.instances))))


def test_each_transition_in_order_opens_and_closes_the_books():
    f, adm, clock = setup()
    a = sorted(f.instances)[0]
    hooks = Counting()
    life = Lifecycle(f, adm, clock, hooks=hooks)
    assert life.state is State.RECEIVED
    life.keyed(k := key(SYSTEM), "t", 2)
    assert (life.state, life.key, life.tenant, life.priority) == (State.KEYED, k, "t", 2)
    assert life.admit(decision(a), 0.0) == [] and life.state is State.ADMITTED and life.waiter is None
    leg = life.dispatch(decision(a))
    inst = f.instances[a]
    assert life.state is State.DISPATCHED and life.leg is leg
    assert (inst.inflight, inst.pending, inst.queued_prefill_tokens) == (1, 1, 48)
    assert f.index.entries(a) == 3 and adm.active_tenants == {"t": 1}
    clock.now = 0.25
    assert life.first_token() is leg and life.state is State.FIRST_TOKEN
    assert (inst.pending, inst.queued_prefill_tokens, f.mean_ttft_s) == (0, 0, 0.25)
    assert life.feedback(cached_tokens=16) is not None
    clock.now = 1.0
    life.finish()
    assert life.state is State.FINISHED and leg.done and at_zero(f, adm)
    assert hooks.calls == [("recorded", a), ("dispatched", a), ("first_token", a), ("finished", a)]


@pytest.mark.parametrize("event, state", [
    ("first_token", State.ADMITTED), ("feedback", State.DISPATCHED), ("retry", State.FIRST_TOKEN),
    ("dispatch", State.DISPATCHED), ("dispatch", State.FIRST_TOKEN), ("keyed", State.ADMITTED),
    ("admit", State.DISPATCHED), ("assigned", State.ADMITTED), ("shed", State.DISPATCHED),
    ("refuse", State.DISPATCHED), ("finish", State.FINISHED), ("first_token", State.FINISHED),
    ("dispatch", State.FINISHED), ("cancel", State.FINISHED), ("finish", State.KEYED),
])
def test_an_event_out_of_order_is_refused_and_changes_nothing(event, state):
    f, adm, clock = setup()
    a = sorted(f.instances)[0]
    life = life_of(f, adm, clock)
    steps = [lambda: life.admit(decision(a), 0.0), lambda: life.dispatch(decision(a)), life.first_token,
             life.finish]
    order = [State.ADMITTED, State.DISPATCHED, State.FIRST_TOKEN, State.FINISHED]
    for step, reached in zip(steps, order):
        if life.state is state:
            break
        step()
        assert life.state is reached
    before, legs = books(f, adm), len(life.legs)
    assert life.state is state
    calls = {"first_token": life.first_token, "feedback": lambda: life.feedback(0), "retry": life.retry,
             "dispatch": lambda: life.dispatch(decision(a)), "keyed": lambda: life.keyed(None),
             "admit": lambda: life.admit(decision(a), 0.0), "assigned": life.assigned, "shed": life.shed,
             "refuse": life.refuse, "finish": life.finish, "cancel": life.cancel}
    with pytest.raises(OutOfOrder):
        calls[event]()
    assert life.state is state and books(f, adm) == before and len(life.legs) == legs


def test_feedback_comes_once_per_leg():
    sent = Sent()
    sent.life.first_token()
    sent.life.feedback(16)
    with pytest.raises(OutOfOrder):
        sent.life.feedback(16)
    sent.life.finish()
    assert sent.at_zero()


def test_a_failure_before_the_first_token_closes_the_books_and_its_chain_never_lands():
    sent = Sent(Counting(), record=False)  # the shell records it a moment later
    sent.life.finish()
    sent.life.record(sent.leg)  # the deferred record comes round after the failure: the chain never arrived
    assert sent.life.state is State.FINISHED and sent.at_zero() and sent.f.index.entries() == 0
    assert sent.hooks.calls == [("dispatched", sent.a), ("finished", sent.a)]


def test_a_deferred_record_lands_once():
    sent = Sent(Counting(), record=False)
    sent.life.record(sent.leg)
    sent.life.record(sent.leg)
    assert sent.f.index.entries(sent.a) == 3 and sent.hooks.calls.count(("recorded", sent.a)) == 1
    sent.life.finish()


def test_a_strategy_without_an_index_records_and_judges_nothing():
    sent = Sent(records=False)
    sent.life.first_token()
    assert sent.life.feedback(64) is None and sent.f.index.entries() == 0
    sent.life.finish()
    assert sent.at_zero()


def _full(f, adm, clock, name: str, tenant: str = "other") -> list[Lifecycle]:
    """`name` at its engine's capacity with requests of `tenant`."""
    lives = []
    while adm.spare(f.instances[name]) > 0:
        life = life_of(f, adm, clock, tenant=tenant)
        life.admit(decision(name, blocks=()), 0.0, queue=False)
        life.dispatch(decision(name, blocks=()))
        lives.append(life)
    return lives


class OneFullInstance:
    """One instance at its engine's capacity (`busy`), and a request of tenant t queued for it (`life`)."""

    def __init__(self, **adm) -> None:
        self.f, self.adm, self.clock = setup(n=1, **adm)
        self.a = sorted(self.f.instances)[0]
        self.busy = _full(self.f, self.adm, self.clock, self.a)
        self.life = self.queued()

    def queued(self, size_bytes: int = 0) -> Lifecycle:
        life = life_of(self.f, self.adm, self.clock)
        life.admit(decision(self.a), 0.0, size_bytes)
        return life

    def slot_freed(self) -> list:
        self.busy.pop().finish()
        return self.adm.pump(0.1)[0]

    def at_zero_after_the_rest(self) -> bool:
        for other in self.busy:
            other.finish()
        return at_zero(self.f, self.adm)


def test_cancel_while_waiting_takes_it_out_of_the_queue():
    q = OneFullInstance()
    life = q.life
    assert life.state is State.WAITING and life.waiter is not None and life.waiter.payload is life
    assert len(q.adm.waiters) == 1
    for early in (life.assigned, life.shed):  # the queue has neither given it a slot nor turned it away
        with pytest.raises(OutOfOrder):
            early()
    life.cancel()
    assert life.state is State.CANCELLED and not q.adm.waiters and q.adm.bytes == 0
    life.close()  # a shell's `finally` after that: nothing more
    assert q.at_zero_after_the_rest()


def test_a_waiting_request_counts_its_bytes_until_it_leaves():
    q = OneFullInstance()
    q.life.cancel()
    sized = q.queued(size_bytes=100)
    assert sized.state is State.WAITING and q.adm.bytes == 100
    sized.close()
    assert q.adm.bytes == 0 and q.at_zero_after_the_rest()


def test_cancel_after_the_queue_gave_it_a_slot_gives_the_slot_back():
    q = OneFullInstance()
    assert [w.payload for w in q.slot_freed()] == [q.life] and q.adm.reserved == {q.a: 1}
    q.life.cancel()  # the client left before the shell took the slot
    assert q.life.state is State.CANCELLED and q.adm.reserved == {}
    assert q.at_zero_after_the_rest()


def test_a_waiter_given_a_slot_is_sent_with_it():
    q = OneFullInstance()
    q.slot_freed()
    q.life.assigned()
    assert q.life.state is State.ADMITTED and q.adm.reserved == {}
    q.life.dispatch(decision(q.a))
    q.life.first_token()
    q.life.finish()
    assert q.at_zero_after_the_rest()


def test_the_queue_refuses_a_waiter_past_its_deadline():
    q = OneFullInstance(timeout_s=1.0)
    _, shed = q.adm.pump(2.0)
    first = q.life
    assert [w.payload for w in shed] == [first] and first.waiter.shed == DEADLINE
    first.shed()
    assert first.state is State.REFUSED and q.at_zero_after_the_rest()


def test_a_request_with_no_place_in_the_queue_is_refused():
    q = OneFullInstance(max_requests=1)
    late = life_of(q.f, q.adm, q.clock)
    with pytest.raises(QueueFull):
        late.admit(decision(q.a), 0.0)
    assert late.state is State.REFUSED and late.waiter is not None and late.waiter.seq not in q.adm.waiters
    q.life.close()
    assert q.at_zero_after_the_rest()


def test_a_retry_to_another_instance_moves_the_books():
    sent = Sent(Counting(), record=False)
    f, adm, a, b, life, hooks = sent.f, sent.adm, sent.a, sent.b, sent.life, sent.hooks
    failed = life.retry()
    assert failed.instance == a and failed.done and life.state is State.ADMITTED
    assert f.instances[a].inflight == 0 and f.instances[a].queued_prefill_tokens == 0
    life.record(failed)  # its deferred record: it never arrived there
    assert f.index.entries(a) == 0
    life.dispatch(decision(b))
    assert f.instances[b].inflight == 1 and [leg.instance for leg in life.legs] == [a, b]
    life.first_token()
    life.finish()
    assert life.state is State.FINISHED and at_zero(f, adm) and f.index.entries(b) == 3
    assert hooks.calls == [("dispatched", a), ("finished", a), ("recorded", b), ("dispatched", b),
                           ("first_token", b), ("finished", b)]


def test_a_retry_that_finds_nowhere_to_go_ends_finished():
    sent = Sent()
    sent.life.retry()
    sent.life.close()
    assert sent.life.state is State.FINISHED and sent.at_zero()


def test_a_request_cut_off_after_its_first_token_closes_once():
    sent = Sent()
    sent.life.first_token()
    sent.life.cancel()
    sent.life.close()
    assert sent.life.state is State.FINISHED and sent.at_zero()


EVENTS = ("admit", "queue", "assigned", "shed", "refuse", "dispatch", "record", "first_token", "feedback", "retry",
          "finish", "cancel", "pump", "other_finishes")


@settings(max_examples=300, deadline=None)
@given(events=st.lists(st.sampled_from(EVENTS), max_size=14))
def test_whatever_the_events_the_books_return_to_zero(events):
    """Any sequence of events, in order or not: each is applied or refused (OutOfOrder), and once the request and
    the ones keeping its instance busy are closed, nothing is left open."""
    f, adm, clock = setup(n=2, capacity=1)
    a, b = sorted(f.instances)
    busy = _full(f, adm, clock, a) + _full(f, adm, clock, b)
    life = life_of(f, adm, clock)
    for event in events:
        clock.now += 0.1
        try:
            if event == "admit":
                life.admit(decision(a), clock.now, queue=False)
            elif event == "queue":
                life.admit(decision(a), clock.now)
            elif event == "assigned":
                life.assigned()
            elif event == "shed":
                life.shed()
            elif event == "refuse":
                life.refuse()
            elif event == "dispatch":
                life.dispatch(decision(b if life.legs else a), record=False)
            elif event == "record" and life.leg is not None:
                life.record(life.leg)
            elif event == "first_token":
                life.first_token()
            elif event == "feedback":
                life.feedback(16)
            elif event == "retry":
                life.retry()
            elif event == "finish":
                life.finish()
            elif event == "cancel":
                life.cancel()
            elif event == "pump":
                adm.pump(clock.now)
            elif event == "other_finishes" and busy:
                busy.pop().finish()
        except (OutOfOrder, QueueFull):
            pass
        assert sum(not leg.done for leg in life.legs) == (life.state in (State.DISPATCHED, State.FIRST_TOKEN))
    life.close()
    assert life.state in ENDED
    for other in busy:
        other.finish()
    assert at_zero(f, adm)
