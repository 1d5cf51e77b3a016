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
    content_format: str  # "string" | "openai": how message content reaches the chat template (vLLM's detection)
    max_chars_per_token: int  # the longest vocabulary entry, in characters (vLLM's character pre-check)
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool) -> Tokens: ...

    def decode(self, ids: list[int]) -> str:
        """/detokenize: special tokens kept, ids outside the vocabulary skipped."""
        ...

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


TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal", "thinking")


def normalize_messages(messages: Sequence[Any], *, openai_parts: bool = False,
                       placeholder: Callable[[MediaItem], str] | None = None,
                       reasoning_alias: bool = False) -> NormalizedChat:
    """vLLM's `parse_chat_messages`: each message becomes a conversation message with only the keys vLLM keeps
    (role, content, tool_calls, reasoning (+ reasoning_content), tool_call_id, name, task, developer tools).

    Content is a string of its text parts joined with newlines (vLLM's "string" content format; media stood in for
    by `placeholder` text where they were), or, with `openai_parts` (the "openai" format vLLM detects in templates
    that loop over `message.content`), a list of `{"type": "text", "text": …}` / `{"type": "image"}` parts; a
    plain string becomes one text part. `reasoning_alias`: read the deprecated `reasoning_content` as `reasoning`
    (the chat-completions request does this; /tokenize does not). Tool-call argument strings are parsed to dicts,
    as vLLM does before templating; empty `tool_calls` are dropped."""
    out: list[dict[str, Any]] = []
    media: list[MediaItem] = []
    for raw in messages:
        if not isinstance(raw, dict):
            raise ChatFormatError("Each message must be an object")
        role = raw.get("role")
        content = raw.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = content
        else:
            raise ChatFormatError("Message content must be a string, a list of parts or null")
        texts: list[str] = []
        wrapped: list[dict[str, Any]] = []
        for part in parts:
            if isinstance(part, str):
                texts.append(part)
                wrapped.append({"type": "text", "text": part})
                continue
            if not isinstance(part, dict):
                raise ChatFormatError("Each content part must be an object")
            ptype = part.get("type", "text")
            if ptype in TEXT_PART_TYPES:
                text = part.get({"refusal": "refusal", "thinking": "thinking"}.get(ptype, "text"))
                if text is None:
                    continue  # vLLM skips a text part without text
                texts.append(str(text))
                wrapped.append({"type": "text", "text": str(text)})
            elif ptype in MM_PART_TYPES:
                item = MediaItem(MM_PART_TYPES[ptype], _media_key(part, ptype))
                media.append(item)
                wrapped.append({"type": item.kind})
                if placeholder is not None:
                    texts.append(placeholder(item))
            else:
                raise ChatFormatError(f"Unknown part type: {ptype}")
        msg: dict[str, Any] = {"role": role, "content": wrapped if openai_parts else "\n".join(texts)}
        reasoning = raw.get("reasoning")
        if reasoning is None and reasoning_alias:
            reasoning = raw.get("reasoning_content")
        if role == "assistant":
            if raw.get("tool_calls") is not None:
                msg["tool_calls"] = _parsed_tool_calls(raw["tool_calls"])
                if not msg["tool_calls"]:
                    del msg["tool_calls"]
            if reasoning is not None:
                msg["reasoning"] = reasoning
                msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in raw:
                msg["tool_call_id"] = raw["tool_call_id"]
            if openai_parts and all(p.get("type") == "text" for p in wrapped):
                msg["content"] = "\n".join(p["text"] for p in wrapped)
        if isinstance(raw.get("name"), str):
            msg["name"] = raw["name"]
        if isinstance(raw.get("task"), str):
            msg["task"] = raw["task"]
        if role == "developer":
            msg["tools"] = raw.get("tools")
        out.append(msg)
    return NormalizedChat(out, media)


def _parsed_tool_calls(calls: Any) -> list[Any]:
    """vLLM's `_postprocess_messages`: arguments become a dict (malformed or non-object JSON → {})."""
    parsed: list[Any] = []
    for call in list(calls):
        if not isinstance(call, dict):
            raise ChatFormatError("assistant tool_calls entries must be objects.")
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, dict):
            fn = dict(fn)
            args = fn.get("arguments")
            if args and isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    args = {}
            fn["arguments"] = args if isinstance(args, dict) else {}
            call["function"] = fn
        parsed.append(call)
    return parsed


def convert_developer_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates that do not know the "developer" role: developer → system, then every system message merged
    into one at the front (vLLM's `_convert_developer_to_system` + `_consolidate_system_messages`)."""
    if not any(m.get("role") == "developer" for m in messages):
        return messages
    converted = []
    for m in messages:
        if m.get("role") == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    system_texts: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m.get("role") != "system":
            others.append(m)
            continue
        if i > 0 or system_texts:
            merge = True
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(str(p["text"]) if isinstance(p, dict) and "text" in p else p
                                for p in content if isinstance(p, (dict, str)) and (isinstance(p, str) or "text" in p))
        if content:
            system_texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


# ---------------------------------------------------------------------------------------------------------------
# Default: 4-byte chunks, MiniMax-style template

CHUNK = 4
VOCAB_SIZE = 200_064  # MiniMax-M2/M3 vocabulary size
# The top of the vocabulary is the simulated model's output vocabulary (pools/sim/behaviour.py: answer token ids);
# prompt text folds into the rest, so a context's generated tokens can be told apart from its prompt.
ANSWER_VOCAB = 4096 + 65536
TEXT_VOCAB_SIZE = VOCAB_SIZE - ANSWER_VOCAB


class ByteTokens:
    __slots__ = ("data", "count")

    def __init__(self, data: bytes) -> None:
        pad = -len(data) % CHUNK
        self.data = data + b"\0" * pad if pad else data
        self.count = len(self.data) // CHUNK

    def ids(self) -> list[int]:
        return [v % TEXT_VOCAB_SIZE for v in array("I", self.data)]  # "I" is 4 bytes on every platform we run on

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
    """Ids are folded 4-byte chunks, so they cannot be inverted; `decode` knows the chunks of ids it has handed out
    (`learn`, called when /tokenize returns ids) and renders any other id from its own 4 little-endian bytes."""

    name = "byte-chunk-4"
    content_format = "string"
    max_chars_per_token = CHUNK  # a 4-byte chunk is at most 4 characters
    vocab_size = VOCAB_SIZE

    def __init__(self) -> None:
        self._chunks: dict[int, bytes] = {}  # at most VOCAB_SIZE entries; a folded collision keeps the latest

    def encode(self, text: str, add_special_tokens: bool) -> ByteTokens:
        return ByteTokens(text.encode("utf-8", "surrogatepass"))

    def learn(self, tokens: Tokens) -> None:
        if isinstance(tokens, ByteTokens):
            d = tokens.data
            chunks = [d[i:i + CHUNK] for i in range(0, len(d), CHUNK)]
            if chunks:
                chunks[-1] = chunks[-1].rstrip(b"\0")  # the padding of the last chunk is not text
            self._chunks.update(zip(tokens.ids(), chunks))

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < VOCAB_SIZE:
                out += self._chunks.get(i) or i.to_bytes(CHUNK, "little").rstrip(b"\0")
        return out.decode("utf-8", "replace")

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


# ---- vLLM's chat-template content-format detection (renderers/hf.py), on the template's jinja AST


def _is_var_access(node: Any, varname: str) -> bool:
    from jinja2 import nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == varname


def _is_attr_access(node: Any, varname: str, key: str) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem):
        return _is_var_access(node.node, varname) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: Any, varname: str, key: str | None = None) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _assigned_names(root: Any, varname: str) -> list[str]:
    from jinja2 import nodes

    names = [varname]
    queue = [varname]
    while queue:
        related = queue.pop(0)
        for assign in root.find_all(nodes.Assign):
            if _is_var_or_elems_access(assign.node, related) and isinstance(assign.target, nodes.Name):
                if assign.target.name != related:
                    names.append(assign.target.name)
                    queue.append(assign.target.name)
    return names


def _loops_over_content(root: Any) -> bool:
    """Whether the template iterates over `message.content` (directly, via a macro parameter bound to it, or as a
    top-level `content` variable): vLLM then passes content as a list of parts ("openai" format)."""
    from jinja2 import nodes

    message_names: list[str] = []
    for messages in _assigned_names(root, "messages"):
        for loop in root.find_all(nodes.For):
            if _is_var_or_elems_access(loop.iter, messages) and isinstance(loop.target, nodes.Name):
                message_names.append(loop.target.name)
    macro_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        param_names = {a.name for a in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(_is_var_or_elems_access(arg, m, "content") for m in message_names):
                        content_params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if kw.key in param_names and any(_is_var_or_elems_access(kw.value, m, "content")
                                                     for m in message_names):
                        content_params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                macro_params_by_loop[id(loop)] = content_params
    for loop in root.find_all(nodes.For):
        if any(_is_var_or_elems_access(loop.iter, m, "content") for m in message_names):
            return True
        params = macro_params_by_loop.get(id(loop))
        if isinstance(loop.iter, nodes.Name):
            if params is not None and loop.iter.name in params:
                return True
            if id(loop) not in loops_in_macros and loop.iter.name == "content":
                return True
    return False


def detect_content_format(env: Any, template: str) -> str:
    """vLLM's `_detect_content_format` with its "string" default."""
    try:
        root = env.parse(template)
    except Exception:
        return "string"
    try:
        return "openai" if _loops_over_content(root) else "string"
    except Exception:
        return "string"


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class HFTokenizer:
    """A local Hugging Face tokenizer: `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`)."""

    def __init__(self, directory: str | Path) -> None:
        from jinja2 import ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(directory)
        self.name = str(path)
        self._tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.max_chars_per_token = max((len(t) for t in vocab), default=1)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
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
        self._cleanup_spaces = bool(config.get("clean_up_tokenization_spaces", False))

        def raise_exception(message: str) -> None:
            from jinja2.exceptions import TemplateError

            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        self._template_source = template or ""
        self._template = env.from_string(template) if template else None
        self.content_format = detect_content_format(env, template) if template else "string"
        self.openai_content_format = self.content_format == "openai"
        self.supports_developer = '"developer"' in self._template_source or "'developer'" in self._template_source

    def encode(self, text: str, add_special_tokens: bool) -> IdTokens:
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return IdTokens(list(enc.ids), list(enc.tokens))

    def decode(self, ids: list[int]) -> str:
        text = str(self._tok.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=False))
        if self._cleanup_spaces:  # transformers' clean_up_tokenization
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool, continue_final_message: bool,
                    template_kwargs: dict[str, Any]) -> str:
        """transformers' `apply_chat_template` (render only), with vLLM's developer-role conversion."""
        if self._template is None:
            raise ChatFormatError("As of transformers v4.44, default chat template is no longer allowed, so you must "
                                  "provide a chat template if the tokenizer does not define one.")
        from jinja2.exceptions import TemplateError

        if not self.supports_developer:
            messages = convert_developer_messages(messages)
        final: str | None = None
        if continue_final_message and messages:
            messages = [*messages[:-1], dict(messages[-1])]
            last = messages[-1]
            content = last.get("content")
            if content is None:
                raise ChatFormatError('continue_final_message is set but the final message has no "content" to '
                                      'continue!')
            if isinstance(content, list):
                parts = [dict(p) if isinstance(p, dict) else p for p in content]
                for part in reversed(parts):
                    if isinstance(part, dict) and "text" in part:
                        final = str(part["text"])
                        part["text"] = final + CONTINUE_TAG
                        break
                else:
                    raise ChatFormatError("continue_final_message is set but we could not find any text to continue "
                                          "in the final message!")
                last["content"] = parts
            else:
                final = str(content)
                last["content"] = final + CONTINUE_TAG
        kwargs = {**self.special_tokens, **template_kwargs}
        try:
            text = self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
        except TemplateError as exc:
            raise ChatFormatError(str(exc)) from None
        if final is not None:
            if final.strip() not in text or CONTINUE_TAG.strip() not in text:
                raise ChatFormatError(
                    "continue_final_message is set but the final message does not appear in the chat after applying "
                    "the chat template! This can happen if the chat template deletes portions of the final message. "
                    "Please verify the chat template and final message in your chat to ensure they are compatible."
                    f"Final message to continue: {final.strip()}\nRendered chat:\n{text}")
            at = text.rindex(CONTINUE_TAG.strip())
            text = text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
        return text

    def expensive(self, text: str) -> bool:
        return len(text) > 20_000


def load_tokenizer(directory: str | None) -> Tokenizer:
    return HFTokenizer(directory) if directory else ByteChunkTokenizer()
