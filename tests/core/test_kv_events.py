"""KV-cache events: decoding both encodings, the exact index they feed, and our chain's continuation."""

from __future__ import annotations

import os
import random

import msgspec
import pytest

from warmroute.core.block_hash import block_hashes, extend_chain
from warmroute.core.exact_index import ExactIndex, pack_tokens, token_chain, token_seed
from warmroute.core.kv_events import (AllBlocksCleared, BadMessage, BlockRemoved, BlockStored, EventSource,
                                      decode_batch, decode_seq, encode_seq, replay_frames,
                                      source_from_vllm)

enc = msgspec.msgpack.encode


def stored_map(hashes, parent, tokens, size, **extra):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


# -- our chain ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1234, 2**64 - 1])
def test_extend_chain_continues_the_whole_chain(seed):
    data = os.urandom(128 * 12)
    full = list(block_hashes(data, seed, 128))
    for depth in range(12):
        parent = full[depth - 1] if depth else seed
        assert extend_chain(parent, depth, data[128 * depth:], 128) == full[depth:]


# -- decoding -----------------------------------------------------------------------------------------------------
def test_decode_tagged_map_events():
    payload = enc([1.5, [stored_map([1, 2], None, list(range(8)), 4, extra_keys=[["salt-a"], None]),
                         {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
                         {"type": "AllBlocksCleared"}], 0])
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0 and batch.skipped == 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored([1, 2], None, list(range(8)), 4, None, "salt-a")
    assert removed == BlockRemoved([2]) and isinstance(cleared, AllBlocksCleared)


def test_decode_positional_events_and_bytes_hashes():
    digest = bytes(range(32))
    payload = enc([2.0, [["BlockStored", [digest], 7, [5, 6], 2, None, "GPU", "adapter-x"],
                         ["BlockStored", [3], None, [1, 2], 2, None],  # SGLang: fewer fields
                         ["BlockRemoved", [digest], "GPU"], ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    low64 = int.from_bytes(digest[-8:], "big")
    assert batch.events[0] == BlockStored([low64], 7, [5, 6], 2, "adapter-x", None)
    assert batch.events[1] == BlockStored([3], None, [1, 2], 2)
    assert batch.events[2] == BlockRemoved([low64]) and isinstance(batch.events[3], AllBlocksCleared)
    assert batch.data_parallel_rank is None


def test_bad_and_unknown_events_are_counted_not_fatal():
    payload = enc([0, [{"type": "Mystery"}, 42, stored_map([1], None, [1, 2, 3], 4),  # wrong token count
                       stored_map([1], None, [1, 2], 2, medium="CPU"),  # offloaded: not ours
                       stored_map(["x"], None, [1, 2], 2), stored_map([9], None, [1, 2], 2)]])
    batch = decode_batch(payload)
    assert batch.skipped == 5 and batch.events == [BlockStored([9], None, [1, 2], 2)]


@pytest.mark.parametrize("payload", [b"", b"\xc1", enc({"a": 1}), enc([1.0]), enc([1.0, 5])])
def test_unreadable_payloads_raise_bad_message(payload):
    with pytest.raises(BadMessage):
        decode_batch(payload)


def test_sequence_frames():
    assert decode_seq(encode_seq(5)) == 5 and decode_seq(encode_seq(-1)) == -1
    assert decode_seq((2**40).to_bytes(8, "big")) == 2**40
    with pytest.raises(BadMessage):
        decode_seq(b"\x00\x01")


# -- the exact index -----------------------------------------------------------------------------------------
BS = 4


def engine_events(tokens: list[int], chunks: list[int], start_hash: int = 1000) -> list[BlockStored]:
    """A prompt stored in pieces of `chunks` blocks, each event naming its parent, with engine hashes unlike ours."""
    events, parent, pos, h = [], None, 0, start_hash
    for n in chunks:
        hashes = list(range(h, h + n))
        events.append(BlockStored(hashes, parent, tokens[pos * BS:(pos + n) * BS], BS))
        parent, pos, h = hashes[-1], pos + n, h + n
    return events


def chain_of(tokens, seed=None):
    data = pack_tokens(tokens)
    return lambda size: token_chain(data, token_seed() if seed is None else seed, size)


def test_events_in_pieces_match_the_whole_prompt():
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(10 * BS)]
    index = ExactIndex()
    index.add_instance("a")
    index.add_instance("b")
    index.apply("a", engine_events(tokens, [3, 1, 2]))  # 6 blocks, in three events
    index.apply("b", engine_events(tokens, [2], start_hash=77))
    prompt = tokens + [1, 2, 3]  # a longer prompt with the same start
    assert index.match_tokens("a", chain_of(prompt), 0.0) == 6 * BS
    assert index.match_tokens("b", chain_of(prompt), 0.0) == 2 * BS
    other = [t + 1 for t in tokens]
    assert index.match_tokens("a", chain_of(other), 0.0) == 0
    # a different LoRA adapter or cache salt never matches
    assert index.match_tokens("a", chain_of(prompt, token_seed("lora-1")), 0.0) == 0


def test_removed_cleared_and_orphans():
    tokens = list(range(6 * BS))
    index = ExactIndex()
    index.add_instance("a")
    events = engine_events(tokens, [2, 2, 2])
    index.apply("a", events)
    assert index.match_tokens("a", chain_of(tokens), 0.0) == 6 * BS
    index.apply("a", [BlockRemoved([1002])])  # the third block: the match stops there
    assert index.match_tokens("a", chain_of(tokens), 0.0) == 2 * BS
    index.apply("a", [AllBlocksCleared()])
    assert index.match_tokens("a", chain_of(tokens), 0.0) == 0 and index.size("a") == 0
    assert index.apply("a", events[1:2]) == 0  # its parent is unknown now: cannot be hashed
    assert index.instances["a"].orphans == 2


def test_memory_is_bounded_and_speculation_expires():
    index = ExactIndex(max_blocks=8, speculative_ttl=1.0)
    index.add_instance("a")
    tokens = list(range(20 * BS))
    index.apply("a", engine_events(tokens, [5, 5, 5, 5]))
    assert index.size("a") == 8 and index.instances["a"].dropped == 12
    assert index.match_tokens("a", chain_of(tokens), 0.0) == 0  # the oldest (the prefix) went first
    new = [t + 7 for t in tokens[: 3 * BS]]
    index.speculate("a", list(chain_of(new)(BS)), now=10.0)
    assert index.match_tokens("a", chain_of(new), 10.5) == 3 * BS
    assert index.match_tokens("a", chain_of(new), 11.5) == 0
    index.speculate("a", list(chain_of(tokens)(BS)), now=20.0)
    assert len(index.instances["a"].speculative) <= 8


def test_partial_blocks_are_skipped_and_larger_blocks_replace_them():
    index = ExactIndex()
    index.add_instance("a")
    tokens = list(range(8 * BS))
    index.apply("a", [BlockStored([1], None, tokens[:2], 2)])  # a partial first block: taken as the size
    index.apply("a", engine_events(tokens, [4]))  # full blocks: the index starts again at their size
    assert index.instances["a"].block_size == BS and index.size("a") == 4
    assert index.apply("a", [BlockStored([99], 1003, tokens[16:18], 2)]) == 0  # partial: not indexed
    assert index.instances["a"].partial == 1 and index.size("a") == 4
    index.apply("a", engine_events(tokens, [4]))  # a prefix hit's blocks reported again: nothing changes
    assert index.size("a") == 4 and index.match_tokens("a", chain_of(tokens), 0.0) == 4 * BS


def test_sources_reported_by_vllm_are_reached_at_the_instances_host():
    body = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                  "replay_endpoint": "tcp://*:5558", "topic": "kv-events", "buffer_steps": 10000}}
    assert source_from_vllm(body, "10.0.0.7") == (EventSource("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558"), "")
    # IPv6 instance, a concrete endpoint (what vLLM reports for tcp://*:0), no replay socket, two ranks
    body = {"1": {"endpoint": "tcp://10.9.9.9:4001"}, "0": {"endpoint": "tcp://10.9.9.9:4000", "replay_endpoint": None}}
    source, note = source_from_vllm(body, "fd00::1")
    assert source == EventSource("tcp://10.9.9.9:4000", None) and "rank 0" in note and "2" in note
    assert source_from_vllm({"0": {"endpoint": "tcp://[::]:5"}}, "fd00::1")[0] == EventSource("tcp://[fd00::1]:5", None)
    assert source_from_vllm({"0": {"endpoint": "ipc:///tmp/kv"}}, "h")[0] == EventSource("ipc:///tmp/kv", None)


@pytest.mark.parametrize("body, why", [({}, "no KV events"),
                                       ({"0": {"endpoint": "tcp://*:1", "enable_kv_cache_events": False}}, "ZMQ"),
                                       ({"0": {"endpoint": "tcp://*:1", "publisher": "null"}}, "ZMQ")])
def test_sources_that_publish_nothing_say_so(body, why):
    source, note = source_from_vllm(body, "h")
    assert source is None and why in note


@pytest.mark.parametrize("body", [[], "x", {"0": "tcp://*:1"}, {"0": {"replay_endpoint": "tcp://*:1"}},
                                  {"\u00b2": {"endpoint": "tcp://*:1"}},  # '²'.isdigit(), but int('²') fails
                                  {"0": {"endpoint": "tcp://*:1"}, "x": {"endpoint": "tcp://*:2"}},
                                  {"0": {"endpoint": "tcp://h:port"}}, {"0": {"endpoint": "udp://h:1"}},
                                  {"0": {"endpoint": "tcp://*:1", "replay_endpoint": "tcp://h"}}])
def test_unreadable_sources_raise_bad_message(body):
    with pytest.raises(BadMessage):
        source_from_vllm(body, "h")


def test_both_replay_framings_are_read():
    """vLLM 0.32 replays [b"", topic, seq, payload] and ends with [b"", b"", END_SEQ, b""]; other versions send
    [b"", seq, payload] and [b"", END_SEQ, b""] (as a DEALER receives them)."""
    seq, end = encode_seq(7), encode_seq(-1)
    assert replay_frames([b"", b"kv", seq, b"p"]) == [b"kv", seq, b"p"]
    assert replay_frames([b"", b"", seq, b"p"]) == [b"", seq, b"p"]  # vLLM's default topic is empty
    assert replay_frames([b"", b"", end, b""]) is None
    assert replay_frames([b"", seq, b"p"]) == [b"", seq, b"p"]
    assert replay_frames([b"", end, b""]) is None
    for bad in ([], [b"x", seq, b"p"], [b"", seq], [b"", b"", b"", seq, b"p"]):
        with pytest.raises(BadMessage):
            replay_frames(bad)
