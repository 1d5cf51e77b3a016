"""Prompt rendering and tokenization for the simulator.

Two tokenizers share one small interface:

- `ByteChunkTokenizer` (default): a token is 4 bytes of UTF-8 (about what a BPE gives for English). Counting is O(1)
  after encoding, ids depend only on the bytes, so equal text prefixes give equal token prefixes, and a 1M-token prompt
  is counted and hashed in milliseconds.
- `HFTokenizer` (`--tokenizer DIR`): a Hugging Face `tokenizer.json` plus the `chat_template` of
  `tokenizer_config.json`, rendered with jinja2 the way transformers/vLLM do, so counts match a real server exactly.

Chat messages are first normalised as vLLM does (content parts → text, multimodal parts counted, tool-call arguments
parsed), then rendered: the default renderer imitates MiniMax's `]~b]role` template; the HF one runs the model's own.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import xxhash

MM_PART_TYPES = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "video_url": "video",
    "video": "video",
    "input_audio": "audio",
    "audio_url": "audio",
}


class ChatFormatError(ValueError):
    """A chat request the template cannot render (vLLM answers these with a 400 BadRequestError)."""


@dataclass(frozen=True)
class MediaItem:
    kind: str  # "image" | "video" | "audio"
    key: str  # what identifies the item (its URL or data); equal keys share cached blocks, as vLLM's mm hashes do


class Tokens(Protocol):
    """One tokenized prompt. `count` is cheap; ids and strings are materialised only when asked for."""

    count: int

    def ids(self) -> list[int]: ...

    def token_strs(self) -> list[str]: ...

    def span_bytes(self, start: int, end: int) -> bytes:
        """A byte string that is equal for two prompts exactly when their tokens [start, end) are equal."""
        ...


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str, add_special_tokens: bool) -> Tokens: ...

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool, continue_final_message: bool,
                    template_kwargs: dict[str, Any]) -> str: ...

    def expensive(self, text: str) -> bool:
        """Whether encoding `text` should leave the event loop (a worker thread)."""
        ...


# ---------------------------------------------------------------------------------------------------------------
# Message normalisation (shared by both renderers)


@dataclass
class NormalizedChat:
    messages: list[dict[str, Any]]
    media: list[MediaItem] = field(default_factory=list)


def _media_key(part: dict[str, Any], ptype: str) -> str:
    value = part.get(ptype)
    if isinstance(value, dict):
        value = value.get("url") or value.get("data") or json.dumps(value, sort_keys=True)
    if value is None:
        value = part.get("url") or part.get("image_url") or part.get("file_id") or ""
    return str(value)


def placeholder_text(item: MediaItem, num_tokens: int) -> str:
    """Text standing for one media item: `num_tokens` 4-byte tokens that differ between items (vLLM's mm hash)."""
    tag = xxhash.xxh32_hexdigest(item.key.encode())[:4]  # 4 ASCII bytes = one byte-chunk token
    return tag * num_tokens


def normalize_messages(messages: Sequence[Any], *, openai_parts: bool = False,
                       placeholder: Callable[[MediaItem], str] | None = None) -> NormalizedChat:
    """Content parts → text joined with newlines (vLLM's "string" content format), media collected (and, with
    `placeholder`, stood in for by text where they were), tool-call argument strings parsed to dicts (as vLLM does
    before templating)."""
    out: list[dict[str, Any]] = []
    media: list[MediaItem] = []
    for raw in messages:
        if not isinstance(raw, dict):
            raise ChatFormatError("Each message must be an object")
        msg = dict(raw)
        content = msg.get("content")
        if isinstance(content, list):
            texts: list[str] = []
            parts_out: list[dict[str, Any]] = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                    parts_out.append({"type": "text", "text": part})
                    continue
                if not isinstance(part, dict):
                    raise ChatFormatError("Each content part must be an object")
                ptype = part.get("type", "text")
                if ptype in ("text", "input_text", "output_text", "refusal"):
                    text = part.get("text", part.get("refusal", ""))
                    texts.append(str(text))
                    parts_out.append({"type": "text", "text": str(text)})
                elif ptype in MM_PART_TYPES:
                    item = MediaItem(MM_PART_TYPES[ptype], _media_key(part, ptype))
                    media.append(item)
                    parts_out.append({"type": item.kind})
                    if placeholder is not None:
                        texts.append(placeholder(item))
                else:
                    raise ChatFormatError(f"Unknown part type: {ptype}")
            msg["content"] = parts_out if openai_parts else "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ChatFormatError("Message content must be a string, a list of parts or null")
        for call in msg.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
        out.append(msg)
    return NormalizedChat(out, media)


# ---------------------------------------------------------------------------------------------------------------
# Default: 4-byte chunks, MiniMax-style template

CHUNK = 4
VOCAB_SIZE = 200_064  # MiniMax-M2/M3 vocabulary size; ids are folded into it


class ByteTokens:
    __slots__ = ("data", "count")

    def __init__(self, data: bytes) -> None:
        pad = -len(data) % CHUNK
        self.data = data + b"\0" * pad if pad else data
        self.count = len(self.data) // CHUNK

    def ids(self) -> list[int]:
        return [v % VOCAB_SIZE for v in array("I", self.data)]  # "I" is 4 bytes on every platform we run on

    def token_strs(self) -> list[str]:
        d = self.data
        return [d[i:i + CHUNK].rstrip(b"\0").decode("utf-8", "replace") for i in range(0, len(d), CHUNK)]

    def span_bytes(self, start: int, end: int) -> bytes:
        return self.data[start * CHUNK:end * CHUNK]


def _tool_json(tool: dict[str, Any]) -> str:
    fn = tool.get("function", tool)
    return json.dumps(fn, ensure_ascii=False, sort_keys=True)


def _render_tool_call_xml(name: str, arguments: Any) -> str:
    args = arguments if isinstance(arguments, dict) else {"input": arguments}
    inner = "".join(f"<{k}>{json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v}</{k}>"
                    for k, v in args.items())
    return f'<tool_call><invoke name="{name}">{inner}</invoke></tool_call>'


def render_minimax(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                   continue_final_message: bool, template_kwargs: dict[str, Any]) -> str:
    """A MiniMax-like template: `]~!b[` begins, `]~b]role\\n` opens a turn, `[e~[\\n` ends it.

    Each message renders independently of later ones, so a conversation's earlier turns are a byte prefix of its
    later prompts (what makes prefix caching work across turns, as with the real template)."""
    out = ["]~!b["]
    msgs = list(messages)
    system = ""
    if msgs and msgs[0].get("role") in ("system", "developer"):
        system = msgs.pop(0).get("content") or ""
    if system or tools:
        out.append("]~b]system\n" + str(system))
        if tools:
            out.append("\n\n# Tools\n<tools>\n" + "\n".join(_tool_json(t) for t in tools) + "\n</tools>")
        out.append("[e~[\n")
    last = len(msgs) - 1
    for i, m in enumerate(msgs):
        role = m.get("role", "user")
        content = m.get("content") or ""
        if role == "assistant":
            body = str(content)
            for call in m.get("tool_calls") or []:
                fn = call.get("function", {})
                body += _render_tool_call_xml(str(fn.get("name", "")), fn.get("arguments", {}))
            out.append("]~b]ai\n" + body)
        elif role == "tool":
            out.append("]~b]tool\n<response>" + str(content) + "</response>")
        else:
            out.append(f"]~b]{'user' if role == 'user' else role}\n" + str(content))
        if not (continue_final_message and i == last):
            out.append("[e~[\n")
    if add_generation_prompt:
        out.append("]~b]ai\n")
        mode = template_kwargs.get("thinking_mode")
        if mode == "enabled":
            out.append("<mm:think>\n")
        elif mode == "disabled":
            out.append("<mm:think></mm:think>\n")
    return "".join(out)


class ByteChunkTokenizer:
    name = "byte-chunk-4"

    def encode(self, text: str, add_special_tokens: bool) -> ByteTokens:
        return ByteTokens(text.encode("utf-8", "surrogatepass"))

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool, continue_final_message: bool,
                    template_kwargs: dict[str, Any]) -> str:
        return render_minimax(messages, tools, add_generation_prompt, continue_final_message, template_kwargs)

    def expensive(self, text: str) -> bool:
        return False


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json + chat_template


class IdTokens:
    __slots__ = ("_ids", "count", "_strs")

    def __init__(self, ids: list[int], strs: list[str] | None = None) -> None:
        self._ids = ids
        self.count = len(ids)
        self._strs = strs

    def ids(self) -> list[int]:
        return self._ids

    def token_strs(self) -> list[str]:
        return list(self._strs or [])

    def span_bytes(self, start: int, end: int) -> bytes:
        return array("q", self._ids[start:end]).tobytes()


def _special(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


_OPENAI_FORMAT = re.compile(r"for\s+\w+\s+in\s+\w+\s*\[\s*['\"]content['\"]\s*\]|\w+\.content\s+is\s+not\s+string"
                            r"|\[\s*['\"]content['\"]\s*\]\s+is\s+(not\s+)?(string|iterable|sequence)")


class HFTokenizer:
    """A local Hugging Face tokenizer: `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`)."""

    def __init__(self, directory: str | Path) -> None:
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(directory)
        self.name = str(path)
        self._tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        self.special_tokens = {k: _special(config.get(k)) for k in
                               ("bos_token", "eos_token", "unk_token", "pad_token") if _special(config.get(k))}

        def raise_exception(message: str) -> None:
            from jinja2.exceptions import TemplateError

            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(template) if template else None
        self.openai_content_format = bool(template and _OPENAI_FORMAT.search(template))

    def encode(self, text: str, add_special_tokens: bool) -> IdTokens:
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return IdTokens(list(enc.ids), list(enc.tokens))

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool, continue_final_message: bool,
                    template_kwargs: dict[str, Any]) -> str:
        if self._template is None:
            raise ChatFormatError("As of transformers v4.44, default chat template is no longer allowed, so you must "
                                  "provide a chat template if the tokenizer does not define one.")
        from jinja2.exceptions import TemplateError

        kwargs = {**self.special_tokens, **template_kwargs}
        try:
            text = self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
        except TemplateError as exc:
            raise ChatFormatError(str(exc)) from None
        if continue_final_message and messages:
            final = messages[-1].get("content")
            if isinstance(final, str) and final and final in text:
                text = text[: text.rindex(final) + len(final)]
        return text

    def expensive(self, text: str) -> bool:
        return len(text) > 20_000


def load_tokenizer(directory: str | None) -> Tokenizer:
    return HFTokenizer(directory) if directory else ByteChunkTokenizer()
