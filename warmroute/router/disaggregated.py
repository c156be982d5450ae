"""The bodies of a split request's two legs, as the engines' KV connectors expect them.

nixl (vLLM's NixlConnector and other P2P connectors): the prefill leg asks for one token, without streaming, with
`kv_transfer_params.do_remote_decode`; its answer's `kv_transfer_params` (the blocks to read, and where) go with
the original request to the decode instance. storage (a shared-storage connector): the same legs, no parameters.
bootstrap (SGLang): the original request to both at once, each naming the prefill instance's bootstrap server
and a room that pairs them.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

# What vLLM's proxies send a prefill instance: compute the prompt, keep its KV for a remote decode.
PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port
MAX_PREFILL_ANSWER = 1 << 20  # bytes: a one-token answer with its transfer parameters is far smaller

_encode = msgspec.json.encode
_decode = msgspec.json.Decoder().decode


def prefill_body(parsed: dict[str, Any], transfer: str) -> bytes:
    """The prefill leg of a nixl or storage split: one token, not streamed (its answer is read whole)."""
    body = {k: v for k, v in parsed.items() if k != "stream_options"}
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if transfer == "nixl":
        body["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return _encode(body)


def with_fields(parsed: dict[str, Any], fields: dict[str, Any]) -> bytes:
    """The request with `fields` added (the decode leg's transfer parameters, or SGLang's bootstrap fields)."""
    return _encode({**parsed, **fields})


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill leg's answer; None where it has none (no connector, or storage)."""
    try:
        parsed = _decode(answer)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) else None


def bootstrap_fields(host: str, port: int | None) -> dict[str, Any]:
    """SGLang's pairing of a request's two legs: the prefill instance's bootstrap server, and a fresh room."""
    return {"bootstrap_host": host, "bootstrap_port": port or SGLANG_BOOTSTRAP_PORT,
            "bootstrap_room": random.getrandbits(63)}
