"""What the emulated engine feeds its model: token ids, from a real tokenizer and chat template.

A model directory (any with `tokenizer.json` and `tokenizer_config.json`, as Hugging Face writes them) is
loaded with the `tokenizers` library; its chat template (`chat_template` in tokenizer_config.json, or a
`chat_template.jinja` file) is rendered with jinja2 as transformers' `apply_chat_template` renders it: a
sandboxed environment with trim_blocks and lstrip_blocks, `messages`, `tools`, `add_generation_prompt`, the
special tokens, `raise_exception` and `strftime_now`, a `tojson` filter that keeps non-ASCII text. As in
vLLM's OpenAI server:
  * a message's content given as a list of parts is flattened to its text parts joined by newlines (vLLM's
    "string" content format); other part kinds (images, audio) are refused;
  * the rendered chat prompt is tokenized without adding special tokens (the template writes them); a text
    completion prompt is tokenized with them; a completion prompt given as token ids is used as is.

By default the engine uses the tiny model's tokenizer (`warmroute make-tiny-model --format hf` writes the
same one), written once into the user's cache directory.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from array import array
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEXT_PARTS = ("text", "input_text", "refusal")  # content part types whose text the prompt carries
TINY_MODEL_MODULE = "warmroute.realengine.hf_model"  # writes the tiny model's tokenizer
SEGMENT_CACHE_TOKENS = 4_000_000  # tokens of recently seen prompt pieces kept (~16 MB as uint32)
CHUNK_CHARS = 1024  # a long piece of prompt text is tokenized (and remembered) in chunks of about this size
_SAFE_CUT = re.compile(r"(?<=[!-~]) (?=[!-~])")  # a space between printable ASCII: a pre-token starts there


class TokenizerError(ValueError):
    """A model directory whose tokenizer or chat template cannot be used."""


class PromptTokenizer:
    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        try:
            self._tokenizer = Tokenizer.from_file(str(self.directory / TOKENIZER_FILE))
            config = json.loads((self.directory / CONFIG_FILE).read_text())
        except Exception as exc:  # OSError, a JSON error, or the plain Exception tokenizers raises
            raise TokenizerError(f"cannot load a tokenizer from {self.directory}: {exc}") from None
        if not isinstance(config, dict):
            raise TokenizerError(f"{self.directory / CONFIG_FILE} is not a JSON object")
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        # No token covers more characters than its own text has (without a normalizer, which may drop some),
        # so a text longer than n times this surely makes more than n tokens.
        spec = json.loads(self._tokenizer.to_str())
        self._max_token_chars = (max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)
                                 if spec.get("normalizer") is None else None)
        self.special_tokens = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
        source = _template_source(config, self.directory)
        self._template = _compile(source) if source is not None else None
        self._splitter = SegmentCache.for_tokenizer(self._tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    # -- prompts ---------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """The text's token ids. ValueError, before tokenizing, if it surely makes more than `max_tokens`."""
        if max_tokens is not None and self._max_token_chars and len(text) > max_tokens * self._max_token_chars:
            raise ValueError(f"the prompt is longer than the {max_tokens:,} tokens this engine can hold")
        if add_special_tokens or self._splitter is None:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self._splitter.encode(text)

    def render_chat(self, messages: Any, tools: Any = None, add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> str:
        """The chat prompt's text. ValueError for messages the engine cannot render."""
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        variables = {**self.special_tokens, **template_kwargs, "messages": _flatten_messages(messages),
                     "tools": tools, "add_generation_prompt": add_generation_prompt}  # kwargs win, as in transformers
        try:
            return self._template.render(variables)
        except Exception as exc:  # raise_exception() in the template, or data it cannot handle (a TypeError, ...)
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None

    def chat_ids(self, body: dict[str, Any], max_tokens: int | None = None) -> list[int]:
        """A /v1/chat/completions body's prompt token ids. ValueError for a body the engine cannot take (or
        whose prompt surely has more than `max_tokens`)."""
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ValueError("'tools' must be a list")
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError("'chat_template_kwargs' must be an object")
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            raise ValueError("'add_generation_prompt' must be true or false")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("messages", "tools", "add_generation_prompt")}
        text = self.render_chat(body.get("messages"), tools, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False, max_tokens=max_tokens)

    def completion_ids(self, prompt: Any, max_tokens: int | None = None) -> list[int]:
        """A /v1/completions `prompt`'s token ids: a string, a list of token ids, or a list holding one of
        those. ValueError for anything else (several prompts in one request are not supported)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.encode(prompt, add_special_tokens=True, max_tokens=max_tokens)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is out of vocabulary (0..{self.vocab_size - 1})")
            ids = prompt
        else:
            raise ValueError("'prompt' must be a string, a list of token ids, or a list holding one of those")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids


class SegmentCache:
    """Tokenizes text piece by piece, remembering recent pieces: exact, and cheap for repeated prefixes.

    The tokenizers library itself cuts its input at added tokens (`<|im_start|>`, ...) and tokenizes the
    pieces between them independently, so joining the pieces' ids gives exactly its result. A byte-level BPE
    whose pre-tokenizer splits text with GPT-2's pattern never merges across a space that has a printable
    ASCII character on either side (the space starts the next pre-token), so a long piece is also cut there,
    about every CHUNK_CHARS. A chat prompt's pieces are mostly its messages and chunks of them, and a system
    prompt, a shared document or a conversation's earlier turns come back request after request: those are
    looked up instead of tokenized again. Cutting also keeps each library call short, where its cost per token
    grows with the input's length. Used only where the cuts are known to be exact (added tokens that match
    plain text, no normalizer); long pieces are cut only for such a byte-level BPE.
    """

    def __init__(self, tokenizer: Any, added: dict[str, int], chunked: bool,
                 max_tokens: int = SEGMENT_CACHE_TOKENS) -> None:
        self._tokenizer = tokenizer
        self._added = added
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
        self._chunked = chunked
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        self._tokens = 0
        self.max_tokens = max_tokens

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> SegmentCache | None:
        spec = json.loads(tokenizer.to_str())
        added = tokenizer.get_added_tokens_decoder()
        if spec.get("normalizer") is not None or not added:
            return None
        if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            return None
        pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
        chunked = (pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
                   and model.get("type") == "BPE" and not model.get("dropout"))
        return cls(tokenizer, {t.content: i for i, t in added.items()}, chunked)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # re.split puts each captured added token between two pieces of text
                ids.append(self._added[piece])
            elif piece:
                for chunk in self._chunks(piece):
                    ids.extend(self._cached(chunk))
        return ids

    def _chunks(self, piece: str) -> list[str]:
        if not self._chunked or len(piece) <= CHUNK_CHARS:
            return [piece]
        out, start = [], 0
        while (cut := _SAFE_CUT.search(piece, start + CHUNK_CHARS)) is not None:
            out.append(piece[start:cut.start()])
            start = cut.start()
        out.append(piece[start:])
        return out

    def _cached(self, piece: str) -> array[int]:
        pieces = self._pieces
        ids = pieces.get(piece)
        if ids is not None:
            pieces.move_to_end(piece)
            return ids
        ids = array("I", self._tokenizer.encode(piece, add_special_tokens=False).ids)
        pieces[piece] = ids
        self._tokens += len(ids)
        while self._tokens > self.max_tokens and pieces:
            self._tokens -= len(pieces.popitem(last=False)[1])
        return ids


# -- the tiny model's tokenizer, written once ---------------------------------------------------------------
def default_tokenizer_dir() -> Path:
    """The tiny model's tokenizer in the user's cache directory, written there on first use."""
    spec = importlib.util.find_spec(TINY_MODEL_MODULE)
    if spec is None or spec.origin is None:
        raise TokenizerError(f"{TINY_MODEL_MODULE} is missing; give a model directory")
    # Keyed by the writer's source, so a changed tokenizer is never read from a stale cache.
    version = hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "warmroute"
    directory = cache / f"tiny-tokenizer-{version}"
    if not (directory / CONFIG_FILE).exists():
        _write_tiny_tokenizer(cache, directory)
    return directory


def _write_tiny_tokenizer(cache: Path, directory: Path) -> None:
    try:
        write_tokenizer = importlib.import_module(TINY_MODEL_MODULE).write_tokenizer
    except (ImportError, AttributeError) as exc:
        raise TokenizerError(f"cannot write the tiny model's tokenizer ({exc}); give a model directory") from None
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=cache))
    try:
        write_tokenizer(staging)
        try:
            staging.rename(directory)
        except OSError:  # another process wrote it first: theirs is the same
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_tokenizer(directory: str | Path | None = None) -> PromptTokenizer:
    """The tokenizer in `directory`, or the tiny model's. TokenizerError if it cannot be used."""
    return PromptTokenizer(default_tokenizer_dir() if directory is None else directory)


# -- internals ----------------------------------------------------------------------------------------------
def _token_text(token: Any) -> str:
    return token["content"] if isinstance(token, dict) else str(token)  # AddedToken objects are saved as dicts


def _template_source(config: dict[str, Any], directory: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (directory / TEMPLATE_FILE).exists():
        template = (directory / TEMPLATE_FILE).read_text()
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{directory / CONFIG_FILE}: chat_template must be a string")
    return template


def _compile(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise TokenizerError(f"the chat template does not compile: {exc}") from None


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _flatten_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        out.append({**m, "content": _content_text(m.get("content"), i)})
    return out


def _content_text(content: Any, i: int) -> str:
    """A message's content as text: parts flattened as vLLM does for templates that take a string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ValueError(f"messages[{i}].content: only text parts are supported, not {kind!r}")
        text = part.get(kind if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise ValueError(f"messages[{i}].content: a {kind!r} part needs a string")
        texts.append(text)
    return "\n".join(texts)

