"""Request -> routing key: the text the engine will cache, in order, plus what must seed its hash.

The key is what decides cache sharing inside the engine: the rendered conversation (roles and text of every
message, tool definitions first, as chat templates place them; an Anthropic Messages request as vLLM turns it
into a chat request), the completion prompt (text or token ids),
or, for SageMaker-style /invocations, the raw body. The model name and any cache salt seed the hash, so
prompts for different models or salts never look alike. The emulated engine renders prompts with the same
functions, so router and engine agree on what a prefix is.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from warmroute.core.block_hash import BLOCK_BYTES_DEFAULT, block_hashes, seed_of

BYTES_PER_TOKEN = 4  # ≈ characters per token for English text; token ids are packed as 4 bytes each

# Routes whose body is OpenAI-style JSON, and what part of it the engine caches.
CHAT_ROUTES = frozenset({"/v1/chat/completions"})
PROMPT_ROUTES = frozenset({"/v1/completions"})
EMBEDDING_ROUTES = frozenset({"/v1/embeddings"})
RESPONSES_ROUTES = frozenset({"/v1/responses"})
ANTHROPIC_ROUTES = frozenset({"/v1/messages"})  # vLLM's Anthropic Messages API (coding agents)
RAW_ROUTES = frozenset({"/invocations"})
ROUTED_PATHS = CHAT_ROUTES | PROMPT_ROUTES | EMBEDDING_ROUTES | RESPONSES_ROUTES | ANTHROPIC_ROUTES | RAW_ROUTES


class KeyError_(ValueError):
    """The body cannot be read as the route requires (shown to the client as a 400)."""


@dataclass
class RoutingKey:
    seed: int  # from model name and cache salt
    # What the engine caches, in order: the rendered text (hashed as its UTF-8 bytes, an ASCII text in place
    # without a copy) or bytes (token ids, a raw body). `data` gives it as bytes.
    source: str | bytes
    prefix_units: str | bytes  # what PrefixLength counts: characters of message text, or body bytes
    session: str | None = None
    model: str | None = None
    _blocks: dict[int, Sequence[int]] = field(default_factory=dict, repr=False)
    # Precise mode (kv_events): the prompt's token ids as the engine will see them, packed 4 bytes each, and the
    # seed of their chain (core/exact_index.py token_seed); None where the router does not tokenize.
    token_data: bytes | None = None
    token_seed: int = 0
    untokenized: str | None = None  # precise mode could not tokenize it: why (prompt_tokens.Untokenizable.cause)
    _token_blocks: dict[int, Sequence[int]] = field(default_factory=dict, repr=False)
    _data: bytes | None = field(default=None, repr=False, compare=False)
    streams: bool = False  # the request asked for a streamed answer ("stream": true): its first chunk is its first token

    @property
    def data(self) -> bytes:
        """What the engine caches, as bytes (a text's UTF-8 encoding, made when first asked)."""
        src = self.source
        if isinstance(src, bytes):
            return src
        if self._data is None:
            self._data = src.encode("utf-8", "surrogatepass")
        return self._data

    @property
    def tokens(self) -> int:
        """Prompt length estimate in tokens (≈ 4 bytes per token)."""
        src = self.source
        # An ASCII text has as many UTF-8 bytes as characters (str.isascii() is a flag, not a scan).
        size = len(src) if isinstance(src, bytes) or src.isascii() else len(self.data)
        return max(1, size // BYTES_PER_TOKEN)

    def blocks(self, block_bytes: int = BLOCK_BYTES_DEFAULT) -> Sequence[int]:
        """Chained hashes of the key's full blocks (computed once per block size): a Chain where the C block
        hash was built (read-only, ints made on access), a list otherwise."""
        got = self._blocks.get(block_bytes)
        if got is None:
            got = self._blocks[block_bytes] = block_hashes(self.source, self.seed, block_bytes)
        return got

    def token_blocks(self, block_size: int) -> Sequence[int]:
        """Chained hashes of the prompt's full token blocks, `block_size` tokens each (once per size); empty
        where it was not tokenized."""
        got = self._token_blocks.get(block_size)
        if got is None:
            data = self.token_data or b""
            got = self._token_blocks[block_size] = block_hashes(data, self.token_seed, block_size * BYTES_PER_TOKEN)
        return got

    def prefix_hash(self, prefix_length: int) -> int:
        """Hash of the first `prefix_length` characters (bytes for raw bodies): the reference's key."""
        head = self.prefix_units[:prefix_length]
        raw = head.encode("utf-8", "surrogatepass") if isinstance(head, str) else head
        return xxhash.xxh3_64_intdigest(raw, self.seed)


# -- rendering (shared with the emulated engine) ----------------------------------------------------------
def content_text(content: Any) -> str:
    """Text of a message's content: a string, or the text parts of a multimodal list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                parts.append(part["text"] if isinstance(part.get("text"), str) else _part_digest(part))
            else:
                raise KeyError_("message content parts must be strings or objects")
        return "".join(parts)
    if isinstance(content, dict) and isinstance(content.get("text"), str):
        return content["text"]
    raise KeyError_("message content must be a string or a list of content parts")


def _part_digest(part: dict) -> str:
    """A non-text part (an image, audio, a tool call or result) occupies the prompt: identify it by a digest of
    the whole part, since two base64 images can share any prefix of their encoding."""
    raw = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"<{part.get('type')}:{xxhash.xxh3_128_hexdigest(raw.encode('utf-8', 'surrogatepass'))}>"


def render_messages(messages: Any, tools: Any = None, strict: bool = False) -> str:
    """A chat conversation as the text the engine will prefill: tools, then each role and its text. `strict`:
    also reject what the OpenAI API rejects (an empty list, a message without role or content)."""
    if not isinstance(messages, list):
        raise KeyError_("'messages' must be a list of message objects")
    if strict and not messages:
        raise KeyError_("'messages' must contain at least one message")
    out = []
    if tools:
        out.append("<|tools|>\n" + json.dumps(tools, sort_keys=True, separators=(",", ":")) + "\n")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise KeyError_(f"messages[{i}] must be an object")
        role = m.get("role") if strict else m.get("role", "user")
        if not isinstance(role, str):
            raise KeyError_(f"messages[{i}].role is required and must be a string" if strict
                            else f"messages[{i}].role must be a string")
        content = m.get("content")
        # What the OpenAI API itself rejects, never forwarded: no content (a tool-calling assistant may leave it null).
        if strict and content is None and not (role == "assistant" and (m.get("tool_calls") or m.get("function_call"))):
            raise KeyError_(f"messages[{i}].content is required")
        out += ("<|", role, "|>\n", content if type(content) is str else content_text(content))
        if m.get("tool_calls"):
            out.append(json.dumps(m["tool_calls"], sort_keys=True, separators=(",", ":")))
        out.append("\n")
    return "".join(out)  # the message texts are copied once, here (not into a formatted string first)


def render_prompt(prompt: Any) -> tuple[str | None, str | bytes]:
    """A completions prompt (text, a list of texts, or token ids): its text (None for token ids), and what the
    engine caches (that text, or the ids packed 4 bytes each)."""
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, _pack_ids(prompt)
        if all(isinstance(p, str) for p in prompt):
            text = "\n".join(prompt)
            return text, text
        if all(isinstance(p, list) for p in prompt):  # a batch of token-id prompts: key on the first
            return render_prompt(prompt[0])
    raise KeyError_("'prompt' must be a string, a list of strings, or a list of token ids")


def _pack_ids(ids: list[int]) -> bytes:
    try:
        return struct.pack(f"<{len(ids)}I", *ids)
    except struct.error:
        raise KeyError_("token ids must be integers from 0 to 2^32-1") from None


def render_responses_input(body: dict) -> str:
    """OpenAI Responses API: instructions, then the input (a string or a list of message items)."""
    text = ""
    if isinstance(body.get("instructions"), str):
        text += f"<|system|>\n{body['instructions']}\n"
    inp = body.get("input")
    if isinstance(inp, str):
        return text + f"<|user|>\n{inp}\n"
    if isinstance(inp, list):
        return text + render_messages([m for m in inp if isinstance(m, dict)], body.get("tools"))
    raise KeyError_("'input' must be a string or a list of input items")


# -- extraction -----------------------------------------------------------------------------------------------
def render_anthropic(body: dict) -> str:
    """Anthropic Messages API as vLLM serves it: the request becomes a chat request (system first, tools as
    functions) and goes through the same template, so it renders, and shares a cache, like the chat route."""
    conversation = render_messages(body.get("messages"), strict=True)  # checked as the client numbered them
    system = body.get("system")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise KeyError_("'tools' must be a list of tool objects")
    head = [{"role": "system", "content": system}] if system else []
    return render_messages(head, [_as_function(t) for t in tools or ()]) + conversation


def _as_function(tool: Any) -> Any:
    if not isinstance(tool, dict) or "name" not in tool:
        return tool  # a server tool (web search...) or malformed: keyed as given
    fn = {"name": tool["name"]}
    if "description" in tool:
        fn["description"] = tool["description"]
    if "input_schema" in tool:
        fn["parameters"] = tool["input_schema"]
    return {"type": "function", "function": fn}


# Seeds by (model, cache salt, adapter), each hashed once: the same few triples come with every request. Bounded,
# since request bodies choose them.
_cached_seed = functools.lru_cache(maxsize=1024)(seed_of)


def _seed(body: dict) -> tuple[int, str | None]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise KeyError_("'model' must be a string")
    model = model or ""
    salt = body.get("cache_salt")
    lora = body.get("lora_adapter") or body.get("adapter")
    seed = _cached_seed(model, salt if isinstance(salt, str) else "", lora if isinstance(lora, str) else "")
    return seed, model or None


def key_for_json(path: str, body: Any, session: str | None = None) -> RoutingKey:
    """Routing key of an OpenAI-style JSON request on `path` (body already parsed)."""
    if not isinstance(body, dict):
        raise KeyError_("request body must be a JSON object")
    key = _key_for_json(path, body, session)
    key.streams = body.get("stream") is True
    return key


def _key_for_json(path: str, body: dict, session: str | None) -> RoutingKey:
    seed, model = _seed(body)
    session = session or (body.get("user") if isinstance(body.get("user"), str) else None)
    if path in CHAT_ROUTES:
        if "messages" not in body:
            raise KeyError_("missing required field 'messages'")
        text = render_messages(body["messages"], body.get("tools"), strict=True)
        return RoutingKey(seed, text, text, session, model)
    if path in PROMPT_ROUTES or path in EMBEDDING_ROUTES:
        field_name = "prompt" if path in PROMPT_ROUTES else "input"
        if field_name not in body:
            raise KeyError_(f"missing required field '{field_name}'")
        text, source = render_prompt(body[field_name])
        return RoutingKey(seed, source, text if text is not None else source, session, model)
    if path in RESPONSES_ROUTES or path in ANTHROPIC_ROUTES:
        text = render_responses_input(body) if path in RESPONSES_ROUTES else render_anthropic(body)
        return RoutingKey(seed, text, text, session, model)
    raise KeyError_(f"no routing key is defined for {path}")


def key_for_raw(body: bytes, session: str | None = None) -> RoutingKey:
    """Routing key of a raw invocation: the body's bytes, as the reference does for /invocations."""
    return RoutingKey(seed_of("invocations"), body, body, session, None)
