"""Precise mode's tokenizer: a request's prompt as the token ids the engine will cache.

Loaded from a model directory as vLLM loads it: the tokenizer from tokenizer.json, its special tokens from
tokenizer_config.json, and the chat template from wherever the engine takes it (template_source: an explicit file,
as vLLM's --chat-template, then chat_template.jinja, chat_template.json, tokenizer_config.json). A chat request is
rendered with the template (list contents flattened to their text parts joined by newlines, vLLM's "string"
content format), and the text tokenized without adding special tokens (the template has them); a completion
prompt is tokenized with them; token-id prompts are used as they are. What cannot be rendered or tokenized
raises KeyError_ with a `cause`; the router then routes on its approximate model (it never refuses for that).

Speed: a long conversation is mostly text the router has tokenized before (the earlier turns, a shared
document). The rendered text is cut at the tokenizer's added tokens (ChatML's <|im_start|> and <|im_end|> around
every turn), which the tokenizer itself cuts at before anything else, and long messages are cut again before
word-starting spaces (_chunks), so each piece tokenizes alone exactly as inside the whole; pieces are cached
(bounded), and only the new ones are tokenized. At load the cuts are checked against whole-text tokenization
on a sample conversation; where they differ (a tokenizer whose pieces depend on their neighbours), the finer
cut, then the coarser, is given up.
"""

from __future__ import annotations

import asyncio
import json
import re
import struct
import sys
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

from warmroute.core.routing_key import KeyError_, content_text

TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TEMPLATE_FILE, PROCESSOR_TEMPLATE_FILE = "chat_template.jinja", "chat_template.json"
TEMPLATE_PLACES = f"--chat-template, {TEMPLATE_FILE}, {PROCESSOR_TEMPLATE_FILE} or {CONFIG_FILE}'s chat_template"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CACHE_BYTES = 64 * 1024 * 1024  # memory for the packed token ids of pieces seen before (with their text)
ENTRY_OVERHEAD = 104  # bytes a cache entry costs beyond its two objects: an OrderedDict's slots and node (measured)
OFFLOAD_CHARS = 4 * 1024  # new text beyond this is tokenized in a worker thread, as it would stall the event loop
CHUNK_CHARS = 1024  # a long message is cut into pieces of about this many characters (see _chunks)
_WORD_START = re.compile(r"(?<=\S) (?=[^\W\d_])")  # a space after a non-space, before a letter
_LONG = "".join(f"Clause {i}: the party's term {i * 7}, (see {i}.{i % 3}) - naïve  \"quoted\"\n\nNext{i} 中文 "
                for i in range(120))  # checks the cuts at load
_SAMPLE = [{"role": "system", "content": "You are a helpful assistant.  Answer briefly."},
           {"role": "user", "content": "Hello there! What's 2+2?\n\nThanks."},
           {"role": "assistant", "content": " It is 4. "}, {"role": "user", "content": "And 3 + 3 ?"}]


class TokenizerError(ValueError):
    """The model directory has no usable tokenizer or chat template (a startup error)."""


class Untokenizable(KeyError_):
    """A request the router cannot render or tokenize as the engine would; `cause` names why, in a few words
    (a metric label): the router routes it on its approximate model instead."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class PromptTokenizer:
    def __init__(self, model_dir: str | Path, cache_bytes: int = CACHE_BYTES, chat_template: str | None = None) -> None:
        """`chat_template`: a template file or the template itself, as vLLM's --chat-template takes it (else the
        model directory's own, see template_source)."""
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError("precise mode needs the `tokenizers` package (pip install tokenizers)") from None
        directory = Path(model_dir)
        path = directory / TOKENIZER_FILE if directory.is_dir() else directory
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own Exception type for a missing or bad file
            hint = "" if path.exists() else (" (precise mode reads a fast tokenizer's tokenizer.json; "
                                             "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) writes one)")
            raise TokenizerError(f"cannot load a tokenizer from {path}: {exc}{hint}") from None
        config = _read_json(path.parent / CONFIG_FILE)
        special_map = _read_json(path.parent / SPECIAL_TOKENS_MAP_FILE)
        # Every special token the template may name, as transformers passes them (tokenizer_config.json first).
        self.special = {k: _token_text(v) for k in SPECIAL_TOKENS
                        if (v := config.get(k, special_map.get(k))) is not None}
        self.templates, self.template_origin = template_source(path.parent, config, chat_template)
        self._compiled: dict[str, Any] = {}
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()  # large bodies get their key built in a thread (Router.key_off_loop)
        self._ready: tuple[dict, bytes] | None = None  # (body, its tokens) from warm(), for tokens_for next
        self._cache_bytes, self._cache_limit = 0, cache_bytes
        self._pieces: dict[str, bytes] = {}
        self._split: re.Pattern | None = None
        self._chunked = False  # long messages cut too, before a space that starts a word (see _chunks)
        sample = self._check_template() if self.templates else None
        cuttable = [t for t in self.tokenizer.get_added_tokens_decoder().values()
                    if not (t.lstrip or t.rstrip or t.single_word)]
        if cuttable:
            self._pieces = {t.content: struct.pack("<I", self.tokenizer.token_to_id(t.content)) for t in cuttable}
            names = sorted(self._pieces, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(re.escape(n) for n in names) + ")")
            if sample is None:
                self._split = None  # nothing to check the cuts on: whole texts only
            else:
                text = self.render(sample[:-1] + [{"role": "user", "content": _LONG}], None)
                whole = _pack(self.tokenizer.encode(text, add_special_tokens=False).ids)
                self._chunked = True
                if self._encode_pieces(text) != whole:
                    self._chunked = False  # cutting inside a message changes the tokens: at added tokens only
                    if self._encode_pieces(text) != whole:
                        self._split = None  # even that changes them: whole texts only

    def _check_template(self) -> list[dict]:
        """Compile the template and render and tokenize a sample with it, so a template that cannot work is one
        line at start-up (TokenizerError); returns the fullest sample it renders (for the cut check)."""
        try:
            for name in self.templates:
                self._template(name)
        except Exception as exc:  # jinja2's TemplateSyntaxError and the like
            raise TokenizerError(f"the chat template from {self.template_origin} does not compile: {exc}") from None
        problem = None
        for sample in (_SAMPLE, _SAMPLE[1:], _SAMPLE[-1:]):  # some templates refuse a system message
            try:
                self.tokenizer.encode(self.render(sample, None), add_special_tokens=False)
                return sample
            except Exception as exc:  # whatever the template or the tokenizer raise
                problem = problem or exc
        raise TokenizerError(f"the chat template from {self.template_origin} cannot render a sample conversation: "
                             f"{problem}")

    # -- requests -------------------------------------------------------------------------------------------
    def tokens_for(self, chat: bool, body: dict) -> bytes:
        """The packed token ids (4 bytes each, little-endian) of a parsed request; Untokenizable where the router
        cannot make them (the engine may still serve it: the caller routes it on the approximate model)."""
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] is body:  # warm() has just done it
            return ready[1]
        if chat:
            return self.chat(body.get("messages"), body.get("tools"), body.get("add_generation_prompt", True))
        prompt = body.get("prompt", body.get("input"))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            try:
                return _pack(prompt)
            except struct.error:
                raise Untokenizable("prompt", "token ids must be integers from 0 to 2^32-1") from None
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompt = prompt[0]  # a batch of prompts: the engine caches each; key on the first
        if not isinstance(prompt, str):
            raise Untokenizable("prompt", "'prompt' must be a string, a list of strings, or a list of token ids")
        return self._cached(prompt, add_special=True)

    def chat(self, messages: Any, tools: Any = None, add_generation_prompt: bool = True) -> bytes:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise Untokenizable("messages", "'messages' must be a list of message objects")
        text = self.render(messages, tools, bool(add_generation_prompt))
        if self._split is None:
            return self._cached(text, add_special=False)
        return self._encode_pieces(text)

    def render(self, messages: list[dict], tools: Any, add_generation_prompt: bool = True) -> str:
        if not self.templates:
            raise Untokenizable("no_chat_template", f"no chat template found ({TEMPLATE_PLACES})")
        try:
            flat = [{**m, "content": _flatten(m.get("content"))} for m in messages]
        except KeyError_ as exc:
            raise Untokenizable("messages", str(exc)) from None
        # As transformers' get_chat_template: of named templates, "tool_use" when tools are given, else "default".
        name = "tool_use" if tools and "tool_use" in self.templates else "default"
        try:
            return self._template(name).render(messages=flat, tools=tools or None,
                                               add_generation_prompt=add_generation_prompt, **self.special)
        except KeyError_:
            raise
        except Exception as exc:  # the template's own errors on odd input
            raise Untokenizable("template_error", f"the chat template cannot render these messages: {exc}") from None

    async def warm(self, chat: bool, body: dict) -> None:
        """Tokenize in a worker thread (the tokenizer releases the GIL) whatever of this request is not cached,
        when that is long enough to stall the event loop; tokens_for, called next for the same body (no await in
        between), then finds it all done."""
        try:
            if chat:
                text = self.render(body.get("messages"), body.get("tools"), body.get("add_generation_prompt", True))
                parts = self._split.split(text)[::2] if self._split is not None else [text]
                todo = [(c, False) for p in parts if p for c in self._chunks(p) if c not in self._cache]
            else:
                prompt = body.get("prompt", body.get("input"))
                todo = [(prompt, True)] if isinstance(prompt, str) and "\x00" + prompt not in self._cache else []
        except Exception:  # whatever it is, tokens_for says what is wrong with it
            return
        if sum(len(piece) for piece, _ in todo) >= OFFLOAD_CHARS:
            encoded = await asyncio.to_thread(self._encode_all, todo)
            for (piece, special), data in zip(todo, encoded):
                self._remember("\x00" + piece if special else piece, data)
        if chat:  # the whole of it now, from the text rendered here: tokens_for need not render it again
            self._ready = (body, self._encode_pieces(text) if self._split is not None
                           else self._cached(text, add_special=False))

    def _encode_all(self, todo: list[tuple[str, bool]]) -> list[bytes]:
        """(In a worker thread: touches no shared state.)"""
        return [_pack(self.tokenizer.encode(text, add_special_tokens=special).ids) for text, special in todo]

    # -- tokenizing, cached ---------------------------------------------------------------------------------
    def _encode_pieces(self, text: str) -> bytes:
        assert self._split is not None
        pieces = self._pieces
        out = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:  # the captured added tokens
                out.append(pieces[part])
            elif part:
                out += [self._cached(chunk, add_special=False) for chunk in self._chunks(part)]
        return b"".join(out)

    def _chunks(self, part: str) -> list[str]:
        """A long message cut every CHUNK_CHARS or so, just before a space that starts a word: byte-level BPE
        pre-tokenizers always start a token there (" word"), and merges never cross it, so each chunk tokenizes
        alone as inside the whole (checked at load on a sample). A document shared by many prompts ahead of a
        unique question (RAG) is then tokenized once, at the same cuts every time."""
        if not self._chunked or len(part) <= CHUNK_CHARS:
            return [part]
        out, start = [], 0
        while len(part) - start > CHUNK_CHARS:
            cut = _WORD_START.search(part, start + CHUNK_CHARS)
            if cut is None:
                break
            out.append(part[start:cut.start()])
            start = cut.start()
        out.append(part[start:])
        return out

    def _cached(self, text: str, add_special: bool) -> bytes:
        key = text if not add_special else "\x00" + text
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                return got
        got = _pack(self.tokenizer.encode(text, add_special_tokens=add_special).ids)
        self._remember(key, got)
        return got

    def _remember(self, key: str, data: bytes) -> None:
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = data
            self._cache_bytes += _entry_bytes(key, data)
            while self._cache_bytes > self._cache_limit and self._cache:
                old_key, old = self._cache.popitem(last=False)
                self._cache_bytes -= _entry_bytes(old_key, old)

    def _template(self, name: str = "default"):
        compiled = self._compiled.get(name)
        if compiled is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # As transformers renders chat templates: loop controls, tojson keeping non-ASCII, strftime_now.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            compiled = self._compiled[name] = env.from_string(self.templates[name])
        return compiled


def template_source(directory: Path, config: dict, explicit: str | None = None) -> tuple[dict[str, str], str]:
    """The chat templates by name ("default" at least; {} for none) and where they came from, as the engine
    finds them: `explicit` (vLLM's --chat-template: a file, or the template itself), else the model directory's
    chat_template.jinja (current transformers' save_pretrained writes it there, and it wins over the config's),
    chat_template.json ({"chat_template": ...}, a processor's), then tokenizer_config.json's chat_template (a
    string, or a list of {name, template})."""
    if explicit is not None:
        return {"default": load_chat_template(explicit)}, explicit if Path(explicit).is_file() else "--chat-template"
    jinja, processor = directory / TEMPLATE_FILE, directory / PROCESSOR_TEMPLATE_FILE
    if jinja.is_file():
        return {"default": _read_text(jinja)}, str(jinja)
    if processor.is_file():
        found = _templates(_read_json(processor).get("chat_template"), processor)
        if found:
            return found, str(processor)
    return _templates(config.get("chat_template"), directory / CONFIG_FILE), str(directory / CONFIG_FILE)


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's text; the value itself where it is plainly a template (has any of
    "{}\n"); a start-up error where it looks like a path that cannot be read."""
    path = Path(value)
    try:
        if path.is_file():
            return _read_text(path)
    except OSError:
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise TokenizerError(f"chat template {value!r} looks like a file path, but it cannot be read")


def _templates(value: Any, origin: Path) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" in named:
            return named
        raise TokenizerError(f"{origin}: chat_template names no 'default' template (it has {sorted(named)})")
    raise TokenizerError(f"{origin}: chat_template must be a string or a list of {{name, template}}")


def _raise(message: str) -> None:
    raise Untokenizable("template_refused", f"the chat template refused the request: {message}")


def _flatten(content: Any) -> Any:
    """vLLM's "string" content format: a list of parts becomes its text parts joined by newlines."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if content is None or isinstance(content, str) else content_text(content)


def _entry_bytes(key: str, data: bytes) -> int:
    """What a cache entry costs in memory: its two objects (headers included, rounded up as the allocator does), the
    UTF-8 copy the tokenizer leaves on a non-ASCII string, and its share of the ordered dict (checked against
    tracemalloc: docs/tuning.md)."""
    size = _rounded(sys.getsizeof(key)) + _rounded(sys.getsizeof(data)) + ENTRY_OVERHEAD
    if not key.isascii():
        size += _rounded(len(key.encode("utf-8", "surrogatepass")) + 1)
    return size


def _rounded(n: int) -> int:
    return (n + 15) & ~15 if n <= 512 else n + 16  # pymalloc's 16-byte classes; malloc's header above that


def _pack(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # the older AddedToken form {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(_read_text(path))
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
