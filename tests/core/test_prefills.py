"""A request held while another at its instance computes the prefix they share (core/prefills.py, through
core/lifecycle.py's `prefill_leader`): who waits for whom, and that the entries go when the legs end."""

from __future__ import annotations

from warmroute.core.admission import Admission, AdmissionSettings
from warmroute.core.lifecycle import Lifecycle
from warmroute.core.strategies import CACHE_HIT, COLD, Decision

from fleet_helpers import SYSTEM, fleet, key


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _decision(name: str, blocks: tuple[int, ...], depth: int) -> Decision:
    d = Decision(name, CACHE_HIT if depth else COLD, depth * 16, len(blocks) * 16, blocks)
    d.depth = depth
    return d


class Fleet:
    """Two instances with room; `send` dispatches a request there with a given chain and predicted depth."""

    def __init__(self) -> None:
        self.f = fleet(2)
        self.adm = Admission(AdmissionSettings(), self.f)
        self.clock = Clock()
        self.a, self.b = sorted(self.f.instances)

    def send(self, name: str, blocks: tuple[int, ...], depth: int = 0, leads: bool = True, role: str = ""):
        life = Lifecycle(self.f, self.adm, self.clock)
        life.keyed(key(SYSTEM))
        d = _decision(name, blocks, depth)
        life.admit(d, self.clock.now, queue=False)
        return life, life.dispatch(d, role=role, leads=leads)


def test_a_request_sharing_a_prefix_still_being_computed_there_waits_for_that_request():
    t = Fleet()
    first, leg = t.send(t.a, (1, 2, 3, 4))
    other, follower = t.send(t.a, (1, 2, 3, 9), depth=3)  # its match there is the first one's chain, not computed yet
    assert other.prefill_leader(follower) is leg
    _, elsewhere = t.send(t.b, (1, 2, 3, 9))
    assert other.prefill_leader(elsewhere) is None  # the other instance computes nothing of it
    first.first_token()  # its prefill is over: the prefix is cached there now
    assert other.prefill_leader(follower) is None


def test_a_request_routed_before_the_other_chain_was_recorded_waits_too():
    """A chain goes into the index a moment after its request is sent: a request routed in between matches nothing
    there, and the first of its blocks is the one being computed."""
    t = Fleet()
    _, leg = t.send(t.a, (1, 2, 3, 4))
    other, follower = t.send(t.a, (1, 2, 3, 7), depth=0)
    assert other.prefill_leader(follower) is leg


def test_a_request_sharing_only_a_short_start_of_a_long_prefill_does_not_wait_for_all_of_it():
    """The engine computes a prompt in order: a short system prompt ahead of another request's long document is
    cached long before that request's first token."""
    t = Fleet()
    t.send(t.a, (1, 2, *range(100, 110)))
    other, follower = t.send(t.a, (1, 2, *range(200, 210)), depth=2)
    assert other.prefill_leader(follower) is None
    half = t.send(t.a, (1, 2, 3, 4, 5, *range(300, 305)), depth=0)[1]
    other, follower = t.send(t.a, (1, 2, 3, 4, 5, 9), depth=5)
    assert other.prefill_leader(follower) is half  # half of what that one computes is its prefix


def test_a_prefix_cached_before_either_request_came_holds_nobody():
    t = Fleet()
    t.send(t.a, (1, 2, 3, 4), depth=3)  # computes only block 4
    other, follower = t.send(t.a, (1, 2, 3, 8), depth=3)
    assert other.prefill_leader(follower) is None


def test_a_leg_never_waits_for_itself_nor_for_one_whose_first_token_says_nothing():
    t = Fleet()
    life, leg = t.send(t.a, (1, 2, 3))
    assert life.prefill_leader(leg) is None
    t2 = Fleet()
    t2.send(t2.a, (1, 2, 3), leads=False)  # an answer not streamed: its first byte comes at its end
    other, follower = t2.send(t2.a, (1, 2, 3), depth=3)
    assert other.prefill_leader(follower) is None


def test_a_decode_leg_computes_no_prompt_so_it_neither_leads_nor_waits():
    t = Fleet()
    _, leg = t.send(t.a, (1, 2, 3))
    _, decode = t.send(t.a, (1, 2, 5), role="decode")
    assert not decode.leads and t.f.prefills.leader(decode, 0) is leg  # it would match...
    life = Lifecycle(t.f, t.adm, t.clock)
    assert life.prefill_leader(decode) is None  # ...but is never held
    third, follower = t.send(t.a, (1, 2, 5), depth=2)
    assert third.prefill_leader(follower) is leg  # the decode leg registered nothing


def test_a_held_request_counts_at_its_instance_and_its_time_to_first_token_starts_when_it_goes():
    t = Fleet()
    t.send(t.a, (1, 2, 3, 4))
    other, follower = t.send(t.a, (1, 2, 3, 9), depth=3)
    assert t.f.instances[t.a].inflight == 2
    t.clock.now = 0.75
    other.resumed(follower)
    assert (follower.held_s, follower.sent_at) == (0.75, 0.75)
    t.clock.now = 1.0
    other.first_token()
    assert t.f.mean_ttft_s == 0.25  # the engine's time, not the hold's


def test_a_later_request_computing_a_prefix_again_is_the_one_waited_for():
    """A prefix computed once, then evicted and computed again by a later request: the later one leads."""
    t = Fleet()
    first, _ = t.send(t.a, (1, 2, 3))
    first.first_token()
    _, again = t.send(t.a, (1, 2, 3), depth=0)  # predicted cold there now
    other, follower = t.send(t.a, (1, 2, 3), depth=3)
    assert other.prefill_leader(follower) is again


def test_the_entries_go_when_their_legs_end_and_when_the_instance_leaves():
    t = Fleet()
    lives = [t.send(t.a, (1, 2, 3, i), depth=i % 3)[0] for i in range(5)]
    lives.append(t.send(t.b, (4, 5))[0])
    assert len(t.f.prefills) > 0
    for life in lives[:3]:
        life.first_token()
        life.finish()
    for life in lives[3:5]:
        life.cancel()
    assert t.f.prefills.computing(t.a) == 0 and t.f.prefills.computing(t.b) == 2
    t.f.remove(t.b)
    assert len(t.f.prefills) == 0
