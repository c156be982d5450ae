"""Reading the engine's cached-token report from responses as they are relayed, whatever the chunking."""

import json

import pytest

from warmroute.router.usage import MAX_CAPTURE, EngineUsage, UsageTap, parse_usage


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def usage(prompt: int, cached: int | None) -> dict:
    u: dict = {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


VLLM_JSON = json.dumps({"id": "c", "choices": [{"message": {"content": 'say "usage": {"cached_tokens": 1}'}}],
                        "usage": usage(700, 512)}).encode()
VLLM_STREAM = (b"".join(sse({"choices": [{"delta": {"content": f"w{i} "}}]}) for i in range(40))
               + sse({"choices": [{"delta": {}, "finish_reason": "length"}]})
               + sse({"choices": [], "usage": usage(700, 496)}) + b"data: [DONE]\n\n")
LLAMA_CPP = json.dumps({"choices": [], "usage": {"prompt_tokens": 700, "completion_tokens": 3},
                        "timings": {"cache_n": 600, "prompt_n": 100, "predicted_n": 3}}).encode()
LLAMA_CPP_TIMINGS_ONLY = sse({"content": "x", "stop": True, "timings": {"cache_n": 64, "prompt_n": 36}})


def relay(data: bytes, size: int) -> EngineUsage | None:
    tap = UsageTap()
    for i in range(0, len(data), size):
        tap.feed(data[i:i + size])
    return tap.result()


@pytest.mark.parametrize("data,want", [
    (VLLM_JSON, EngineUsage(512, 700)),
    (VLLM_STREAM, EngineUsage(496, 700)),
    (LLAMA_CPP, EngineUsage(600, 700)),
    (LLAMA_CPP_TIMINGS_ONLY, EngineUsage(64, 100)),
], ids=["vllm-json", "vllm-stream", "llama.cpp", "llama.cpp-timings"])
def test_the_report_is_found_at_every_chunk_size(data, want):
    for size in (*range(1, 24), 64, 100, 1000, len(data)):
        assert relay(data, size) == want, size


def test_a_key_split_at_every_offset_is_found():
    data = VLLM_STREAM
    at = data.index(b'"usage"')
    for cut in range(at - 2, at + 9):
        tap = UsageTap()
        tap.feed(data[:cut])
        tap.feed(data[cut:])
        assert tap.result() == EngineUsage(496, 700), cut


def test_usage_in_every_chunk_keeps_the_capture_bounded_and_reads_the_last():
    data = b"".join(sse({"choices": [{"delta": {"content": "w"}}], "usage": usage(700, 448)}) for _ in range(2000))
    tap = UsageTap()
    for i in range(0, len(data), 150):
        tap.feed(data[i:i + 150])
        assert len(tap._capture or b"") <= MAX_CAPTURE
    assert tap.result() == EngineUsage(448, 700)


@pytest.mark.parametrize("data", [
    json.dumps({"choices": [], "usage": usage(700, None)}).encode(),  # vLLM without --enable-prompt-tokens-details
    json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "prompt_tokens_details": None}}).encode(),
    json.dumps({"choices": [], "usage": usage(700, 900)}).encode(),  # more cached than prompt: not believable
    json.dumps({"usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": "7"}}}).encode(),
    json.dumps({"choices": [{"text": "no report at all"}]}).encode(),
    b'{"usage": {"prompt_tokens": 700, "prompt_tokens_details": {"cached_to',  # cut off
    b"not json at all",
])
def test_no_believable_report_gives_none(data):
    assert relay(data, 7) is None


def test_a_cut_off_last_report_falls_back_to_an_earlier_complete_one():
    text = sse({"usage": usage(700, 320)}).decode() + 'data: {"usage": {"prompt_tokens": 700, "prompt_tok'
    assert parse_usage(text) == EngineUsage(320, 700)
