"""Workload generators: reproducible, skewed as configured, multi-turn histories grow, traces parse."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest

from warmroute.core.routing_key import key_for_json
from warmroute.errors import UsageError
from warmroute.workloads import WORKLOADS, make_workload, parse_params
from warmroute.workloads.text import BLOCK_CHARS, block_text, filler, rng_for
from warmroute.workloads.trace import load_trace
from warmroute.workloads.zipf import Zipf

SYNTHETIC = [name for name in WORKLOADS if name != "trace"]
MOONCAKE = Path(__file__).parents[1] / "data" / "mooncake_conversation_head50.jsonl"  # a real trace's head (data/README.md)


def first(workload, n: int):
    return list(islice(workload.requests(), n))


def bodies(workload, n: int) -> list[str]:
    return [json.dumps(r.body, sort_keys=True) for r in first(workload, n)]


# -- determinism and text ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SYNTHETIC)
def test_same_seed_same_requests_other_seed_others(name):
    assert bodies(make_workload(name, seed=3), 40) == bodies(make_workload(name, seed=3), 40)
    assert bodies(make_workload(name, seed=3), 40) != bodies(make_workload(name, seed=4), 40)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_sessions_restart_from_the_seed(name):
    w = make_workload(name, seed=1)
    assert bodies(w, 20) == bodies(w, 20)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_every_request_has_a_unique_tail(name):
    reqs = first(make_workload(name), 300)
    last_user = [next(m["content"] for m in reversed(r.body["messages"]) if m["role"] == "user") for r in reqs]
    assert len(set(last_user)) == len(reqs)


def test_filler_is_exact_length_words():
    text = filler(rng_for(0, "t"), 1000)
    assert len(text) == 1000 and text.isascii()
    assert len(text.split()) > 100  # words, not one blob


def test_block_text_is_fixed_per_id():
    assert block_text(7) == block_text(7) and len(block_text(7)) == BLOCK_CHARS
    assert block_text(7) != block_text(8)


def test_prompt_tokens_match_the_routing_key():
    r = first(make_workload("shared", system_tokens=1000), 1)[0]
    assert r.prompt_tokens == key_for_json(r.path, r.body).tokens
    assert 1000 <= r.prompt_tokens <= 1000 + 40 + 10  # system + question + role markers


# -- popularity ------------------------------------------------------------------------------------------------
def test_zipf_skew_follows_the_exponent():
    import random

    z, rng = Zipf(20, 1.0), random.Random(0)
    counts = Counter(z.sample(rng) for _ in range(20_000))
    assert counts[0] > counts[1] > counts[4] > counts[19]
    assert counts[0] / 20_000 == pytest.approx(z.share(0), abs=0.02)
    flat = Counter(Zipf(20, 0.0).sample(rng) for _ in range(20_000))
    assert max(flat.values()) / min(flat.values()) < 1.3


def test_shared_prompts_are_zipf_popular():
    reqs = first(make_workload("shared", pool_size=10, zipf=1.0, system_tokens=50), 3000)
    counts = Counter(r.body["messages"][0]["content"] for r in reqs)
    ranked = [n for _, n in counts.most_common()]
    assert len(counts) == 10 and ranked[0] > 2.5 * ranked[-1]


@pytest.mark.parametrize("hot", [0.6, 0.9])
def test_hot_prompt_takes_its_share(hot):
    reqs = first(make_workload("hot", hot=hot, system_tokens=50), 2000)
    tags = Counter(r.tag for r in reqs)
    assert tags["hot"] / len(reqs) == pytest.approx(hot, abs=0.04)
    assert len({r.body["messages"][0]["content"] for r in reqs if r.tag == "hot"}) == 1


def test_default_hot_share_is_60_percent():
    assert make_workload("hot").hot == 0.6


def test_mixed_blends_parts_by_request_share():
    w = make_workload("mixed")
    tags = Counter(r.tag for r in first(w, 3000))
    shares = {"shared": w.shared_share, "rag": w.rag_share, "chat": w.chat_share, "hot": w.hot_share}
    for tag, share in shares.items():
        assert tags[tag] / 3000 == pytest.approx(share, abs=0.05)


def test_rag_retrieves_distinct_popular_documents():
    reqs = first(make_workload("rag", docs=8, docs_per_request=3, doc_tokens=30), 200)
    for r in reqs:
        docs = r.body["messages"][1]["content"].split("\n\n")[:3]
        assert len(set(docs)) == 3
    firsts = Counter(r.body["messages"][1]["content"][:60] for r in reqs)
    assert len(firsts) > 1


# -- multi-turn ------------------------------------------------------------------------------------------------
def test_chat_history_grows_turn_by_turn():
    session = next(make_workload("chat", min_turns=3, max_turns=5).sessions())
    reqs = session.requests
    assert 3 <= len(reqs) <= 5
    assert [r.turn for r in reqs] == list(range(len(reqs)))
    assert len({r.session for r in reqs}) == 1
    for prev, nxt in zip(reqs, reqs[1:]):
        m0, m1 = prev.body["messages"], nxt.body["messages"]
        assert m1[: len(m0)] == m0  # the next prompt extends the previous one
        assert m1[len(m0)]["role"] == "assistant" and m1[-1]["role"] == "user"
        assert nxt.prompt_tokens > prev.prompt_tokens
        assert key_for_json(nxt.path, nxt.body).data.startswith(key_for_json(prev.path, prev.body).data)


def test_chat_mean_turns():
    assert make_workload("chat", min_turns=2, max_turns=6).mean_requests_per_session() == 4


# -- working set -----------------------------------------------------------------------------------------------
def test_working_set_tokens():
    assert make_workload("shared", pool_size=10, system_tokens=100).working_set_tokens() == 1000
    assert make_workload("hot", pool_size=10, system_tokens=100).working_set_tokens() == 1100
    assert make_workload("rag", systems=1, system_tokens=10, docs=5, doc_tokens=100).working_set_tokens() == 510
    chat = make_workload("chat")
    assert chat.working_set_tokens(16) > chat.working_set_tokens(1)
    mixed = make_workload("mixed")
    assert mixed.working_set_tokens(16) > make_workload("shared").working_set_tokens()


# -- registry --------------------------------------------------------------------------------------------------
def test_make_workload_errors_are_one_line():
    with pytest.raises(UsageError, match="unknown workload 'nope'"):
        make_workload("nope")
    with pytest.raises(UsageError, match="no parameter 'colour'"):
        make_workload("shared", colour="red")
    with pytest.raises(UsageError, match="expected int"):
        make_workload("shared", **parse_params(["pool_size=many"]))
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_params(["pool_size"])


@pytest.mark.parametrize("name, params, message", [
    ("shared", {"pool_size": 0}, "pool_size must be >= 1"),
    ("shared", {"system_tokens": -5}, "system_tokens must be >= 0"),
    ("hot", {"hot": 1.5}, "hot must be between 0 and 1"),
    ("rag", {"docs": 0}, "docs must be >= 1"),
    ("chat", {"min_turns": 5, "max_turns": 2}, "max_turns must be >= min_turns"),
    ("mixed", {"shared_share": 0, "rag_share": 0, "chat_share": 0, "hot_share": 0}, "at least one share"),
    ("mixed", {"max_tokens": 0}, "max_tokens must be >= 1"),
])
def test_bad_sizes_are_usage_errors(name, params, message):
    with pytest.raises(UsageError, match=message):
        make_workload(name, **params)


def test_params_from_strings_are_converted():
    w = make_workload("shared", **parse_params(["pool-size=5", "zipf=0.8"]))
    assert (w.pool_size, w.zipf) == (5, 0.8)


# -- trace replay ----------------------------------------------------------------------------------------------
def write_trace(path: Path, lines: list[object]) -> str:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


FIXTURE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 700, "output_length": 0, "hash_ids": [0, 3]},
    {"timestamp": 1500, "input_length": 300, "output_length": 5, "hash_ids": [4]},
]


def test_trace_replay_maps_blocks_to_fixed_text(tmp_path):
    w = make_workload("trace", path=write_trace(tmp_path / "t.jsonl", FIXTURE))
    reqs = list(w.requests())
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.5]
    assert [r.path for r in reqs] == ["/v1/completions"] * 3
    assert [r.prompt_tokens for r in reqs] == [1100, 700, 300]
    assert [r.max_tokens for r in reqs] == [10, 1, 5]
    p0, p1 = reqs[0].body["prompt"], reqs[1].body["prompt"]
    assert p0[:BLOCK_CHARS] == p1[:BLOCK_CHARS] == block_text(0)  # shared hash id 0: shared first block
    assert p0[BLOCK_CHARS:2 * BLOCK_CHARS] != p1[BLOCK_CHARS:2 * BLOCK_CHARS]
    assert w.working_set_tokens() == 512  # only block 0 is reused


def test_trace_limit_and_output_cap(tmp_path):
    w = make_workload("trace", path=write_trace(tmp_path / "t.jsonl", FIXTURE), limit=2, max_tokens=4)
    assert [r.max_tokens for r in w.requests()] == [4, 1]


def test_trace_replay_from_a_later_start(tmp_path):
    w = make_workload("trace", path=write_trace(tmp_path / "t.jsonl", FIXTURE), **parse_params(["start_s=0.5"]))
    reqs = list(w.requests())
    assert [r.arrival_s for r in reqs] == [0.0, 1.0]  # the first request skipped, the clock shifted to the start
    assert [r.prompt_tokens for r in reqs] == [700, 300]
    with pytest.raises(UsageError, match="start_s"):
        make_workload("trace", path=write_trace(tmp_path / "t.jsonl", FIXTURE), start_s=-1.0).validate()


@pytest.mark.parametrize("bad, message", [
    ("{not json", "t.jsonl:2: not valid JSON"),
    ("[1, 2]", "t.jsonl:2: expected a JSON object"),
    ({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}, "'timestamp'"),
    ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [0]}, "'input_length'"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}, "'hash_ids'"),
    ({"timestamp": 0, "input_length": 5, "output_length": 1}, "'hash_ids'"),
])
def test_malformed_trace_lines_name_the_line(tmp_path, bad, message):
    path = write_trace(tmp_path / "t.jsonl", [FIXTURE[0], bad])
    with pytest.raises(UsageError, match=message) as info:
        make_workload("trace", path=path)
    assert "\n" not in str(info.value)


def test_unreadable_or_empty_trace(tmp_path):
    with pytest.raises(UsageError, match="cannot read trace"):
        make_workload("trace", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(UsageError, match="has no requests"):
        make_workload("trace", path=write_trace(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(UsageError, match="needs a trace file"):
        make_workload("trace")


def test_real_mooncake_trace_prefixes_are_shared():
    records = load_trace(str(MOONCAKE), limit=50)
    w = make_workload("trace", path=str(MOONCAKE), limit=50)
    reqs = list(w.requests())
    assert len(reqs) == 50
    for rec, req in zip(records, reqs):
        assert req.prompt_tokens == rec.input_length
    # The first two requests share hash id 0: their prompts share the first 512-token block.
    assert reqs[0].body["prompt"][:BLOCK_CHARS] == reqs[1].body["prompt"][:BLOCK_CHARS]


# -- several tenants ----------------------------------------------------------------------------------------
def test_a_tenant_stream_with_a_start_joins_then_at_its_rate():
    """A tenant joining a running fleet (`start_s`): none of its sessions before its start, then its rate; the
    others' unchanged; a negative start is refused."""
    from warmroute.workloads.tenants import Tenants, TenantStream

    quiet = TenantStream("quiet", make_workload("mixed", seed=1), 2.0)
    late = Tenants(seed=0, duration_s=200.0, streams=(quiet, TenantStream("noisy", make_workload("mixed", seed=2),
                                                                          10.0, start_s=150.0)))
    at_once = Tenants(seed=0, duration_s=200.0, streams=(quiet, TenantStream("noisy", make_workload("mixed", seed=2),
                                                                             10.0)))
    noisy = [s.arrival_s for s in late.sessions() if s.requests[0].tenant == "noisy"]
    assert noisy and min(noisy) >= 150.0
    assert 0.6 * 500 < sum(len(s.requests) for s in late.sessions() if s.requests[0].tenant == "noisy") < 1.4 * 500
    assert [s.arrival_s for s in late.sessions() if s.requests[0].tenant == "quiet"] == \
        [s.arrival_s for s in at_once.sessions() if s.requests[0].tenant == "quiet"]
    with pytest.raises(ValueError):
        Tenants(streams=(TenantStream("x", make_workload("mixed", seed=1), 1.0, start_s=-1.0),)).validate()


def test_tenants_interleave_each_at_its_own_rate_in_arrival_order():
    """Each tenant's own workload at its own Poisson rate, every request marked with its tenant, the sessions of
    all in arrival order and within the duration; the same seed gives the same stream."""
    from warmroute.workloads.tenants import Tenants, TenantStream

    def stream(seed: int) -> Tenants:
        return Tenants(seed=seed, duration_s=200.0, streams=(
            TenantStream("quiet", make_workload("mixed", seed=1), 2.0),
            TenantStream("noisy", make_workload("mixed", seed=2), 10.0)))

    sessions = list(stream(0).sessions())
    starts = [s.arrival_s for s in sessions]
    assert starts == sorted(starts) and 0 < starts[0] and starts[-1] < 200.0
    requests = Counter()
    for s in sessions:
        assert len({r.tenant for r in s.requests}) == 1 and all(r.arrival_s is None for r in s.requests[1:])
        requests[s.requests[0].tenant] += len(s.requests)
    assert 0.8 * 400 < requests["quiet"] < 1.2 * 400 and 0.8 * 2000 < requests["noisy"] < 1.2 * 2000
    assert [s.id for s in islice(stream(0).sessions(), 50)] == [s.id for s in sessions[:50]]
    assert [s.arrival_s for s in islice(stream(1).sessions(), 5)] != starts[:5]
    with pytest.raises(ValueError):
        Tenants(streams=())
