"""What a request needs from a pool: its context length, modalities and thinking mode (`RequestProfile`).

`classify` reads an OpenAI chat / completions / Responses or Anthropic messages body, already parsed from JSON, and
renders it roughly as the chat template will (role markers, tool schemas, tool calls and results, earlier reasoning)
so the token estimate covers what the replica will actually see. Invalid shapes become `RequestRejected` (400) naming
the field, and nothing else is ever raised, whatever JSON arrives. An ordinary short chat costs tens of µs here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import orjson

from policies.errors import RequestRejected
from policies.media import base64_payload_start, image_size_from_base64, image_tokens
from policies.tokens import TokenCount, TokenCounter
from policies.config import ClassificationConfig, ThinkingMode

Api = Literal["chat", "completions", "responses", "messages"]

APIS: frozenset[str] = frozenset(get_args(Api))
THINKING_MODES: frozenset[str] = frozenset(get_args(ThinkingMode))

# Template tokens that are not text: a chat template wraps each message in begin/role/end markers, each tool call in
# call tags, and ends with the assistant's generation prompt. Model tokens, so not scaled by calibration_factor.
MESSAGE_OVERHEAD_TOKENS = 4
TOOL_CALL_OVERHEAD_TOKENS = 8
TOOLS_OVERHEAD_TOKENS = 16
GENERATION_PROMPT_TOKENS = 3

# The field that holds the prompt, per API: where "the prompt is too long" points.
PROMPT_FIELD: dict[str, str] = {
    "chat": "messages", "completions": "prompt", "responses": "input", "messages": "messages",
}
_MESSAGES_SHAPE = 'a list of messages such as [{"role": "user", "content": "Hi"}]'

# Which request fields bound the output, per API, first found wins.
_BUDGET_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
    "messages": ("max_tokens",),
}

_TEXT_ONLY: frozenset[str] = frozenset({"text"})
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
_IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})
_AUDIO_PARTS = frozenset({"input_audio", "audio_url", "audio"})

Loc = tuple[str | int, ...]


@dataclass(slots=True)
class RequestProfile:
    """A request as pool choice sees it. Token counts are in the model's tokens (after calibration).

    Read-only by convention (change it with `dataclasses.replace`); not frozen because a frozen dataclass is ~4x
    slower to build, and one is built per request."""

    api: Api
    model: str | None  # None when the body names no model (vLLM then uses its only one)
    prompt_tokens: int  # text estimate × calibration_factor + template markers + image/video tokens
    output_budget: int  # tokens the request may generate, thinking included
    budget_explicit: bool  # the caller set max_tokens (or its API's equivalent)
    modalities: frozenset[str]  # always has "text"; "image" / "video" when the request carries them
    thinking_mode: ThinkingMode
    stream: bool
    n_images: int = 0
    n_videos: int = 0
    estimate_exact: bool = True  # False when a long text was estimated from samples
    budget_field: str | None = None  # the request field that set output_budget (None when defaulted)
    model_counted: bool = False  # True once prompt_tokens came from a replica's /tokenize: no margin, no recount
    estimate_error: float = 0.0  # relative error bound of a sampled estimate (pool choice adds it to its band)
    estimate_refinable: bool = False  # a coarse sample: classify(..., precise=True) would state a tighter bound

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_budget

    def with_prompt_tokens(self, prompt_tokens: int) -> RequestProfile:
        """A copy with another prompt estimate: `dataclasses.replace` costs ~3 µs, this ~0.8 (once per request when
        a pool's learned token ratio applies). Every field is passed: tests compare all of them."""
        return RequestProfile(self.api, self.model, prompt_tokens, self.output_budget, self.budget_explicit,
                              self.modalities, self.thinking_mode, self.stream, self.n_images, self.n_videos,
                              self.estimate_exact, self.budget_field, self.model_counted, self.estimate_error,
                              self.estimate_refinable)


def classify(body: Any, api: str, cfg: ClassificationConfig, counter: TokenCounter, precise: bool = False
             ) -> RequestProfile:
    """Profile a parsed request body, or raise RequestRejected saying what to fix; `precise`: see TokenCounter."""
    if api not in APIS:
        raise ValueError(f"unknown api {api!r}; expected one of {sorted(APIS)}")  # a gateway bug, not the caller's
    if not isinstance(body, dict):
        raise RequestRejected("The request body must be a JSON object.", code="invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad_type(("model",), "a string")
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise _bad_type(("stream",), "a boolean")
    prompt = _Prompt(cfg)
    if api == "chat":
        prompt.chat(body)
    elif api == "completions":
        prompt.completions(body)
    elif api == "responses":
        prompt.responses(body)
    else:
        prompt.anthropic(body)
    mode = _thinking_mode(body, api)
    budget, budget_field = _output_budget(body, api, mode, cfg)

    if api == "completions":  # separate prompts: the largest decides; token ids are model tokens already
        count = TokenCount(0, True)
        for text in prompt.alternatives:
            measured = counter.measure(text, precise)
            if measured.tokens > count.tokens:
                count = measured
        text_tokens = max(math.ceil(count.tokens * cfg.calibration_factor), prompt.token_ids)
    else:
        count = counter.measure_pieces(prompt.texts, precise)
        text_tokens = math.ceil(count.tokens * cfg.calibration_factor) + GENERATION_PROMPT_TOKENS
    n_images, n_videos = prompt.n_images, prompt.n_videos
    if n_images or n_videos:
        modalities = frozenset(("text", *(("image",) if n_images else ()), *(("video",) if n_videos else ())))
    else:
        modalities = _TEXT_ONLY
    # By position, in RequestProfile's field order (one per request; keywords cost ~0.3 µs more)
    return RequestProfile(
        api,  # type: ignore[arg-type]  # checked against APIS above
        model,
        text_tokens + prompt.overhead + prompt.media_tokens,  # prompt_tokens
        budget,  # output_budget
        budget_field is not None,  # budget_explicit
        modalities,
        mode,  # thinking_mode
        stream,
        n_images,
        n_videos,
        count.exact,  # estimate_exact
        budget_field,
        False,  # model_counted
        count.error,  # estimate_error
        count.refinable,  # estimate_refinable
    )


# ---------------------------------------------------------------------------------------------------------------
# Fields other than the prompt


def _known_mode(value: Any, param: str, unset_note: str) -> ThinkingMode:
    if not isinstance(value, str) or value not in THINKING_MODES:
        raise RequestRejected(
            f"{param} must be one of 'enabled', 'adaptive' or 'disabled'{unset_note}; got {_show(value)}.",
            param=param,
            code="invalid_value",
        )
    return value  # type: ignore[return-value]


def _thinking_mode(body: dict[str, Any], api: str) -> ThinkingMode:
    """`chat_template_kwargs.thinking_mode` (what the MiniMax template reads) wins; then the API's own switch."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise _bad_type(("chat_template_kwargs",), "an object")
        mode = kwargs.get("thinking_mode")
        if mode is not None:
            return _known_mode(mode, "chat_template_kwargs.thinking_mode", " (or unset, which means 'adaptive')")
    if api == "messages":
        thinking = body.get("thinking")
        if thinking is None:
            return "adaptive"
        if not isinstance(thinking, dict):
            raise _bad_type(("thinking",), 'an object such as {"type": "enabled", "budget_tokens": 8192}')
        return _known_mode(thinking.get("type"), "thinking.type", "")
    if api == "responses":
        reasoning = body.get("reasoning")
        if reasoning is None:
            return "adaptive"
        if not isinstance(reasoning, dict):
            raise _bad_type(("reasoning",), 'an object such as {"effort": "none"}')
        effort = reasoning.get("effort")
        if effort is not None and not isinstance(effort, str):
            raise _bad_type(("reasoning", "effort"), "a string")
        return "disabled" if effort == "none" else "adaptive"
    return "adaptive"


def _output_budget(
    body: dict[str, Any], api: str, mode: ThinkingMode, cfg: ClassificationConfig
) -> tuple[int, str | None]:
    """The caller's output cap and its field, else the default reserve for the thinking mode (thinking is output)."""
    found: tuple[int, str] | None = None
    for name in _BUDGET_FIELDS[api]:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise RequestRejected(
                f"{name} must be a positive integer (the most tokens to generate, thinking included); "
                f"got {_show(value)}.",
                param=name,
                code="invalid_value" if isinstance(value, int) and not isinstance(value, bool) else "invalid_type",
            )
        if found is None:
            found = value, name
    if found is not None:
        return found
    if api == "completions":
        return cfg.output_budget.completions, None
    return cfg.output_budget.for_mode(mode), None


# ---------------------------------------------------------------------------------------------------------------
# The prompt, rendered as text pieces plus token counts that are not text


class _Prompt:
    """Accumulates what a chat template would render: text pieces (counted together later) and fixed tokens."""

    __slots__ = ("cfg", "texts", "alternatives", "token_ids", "overhead", "media_tokens", "n_images", "n_videos")

    def __init__(self, cfg: ClassificationConfig) -> None:
        self.cfg = cfg
        self.texts: list[str] = []  # one prompt, counted as the sum of its pieces
        self.alternatives: list[str] = []  # completions: prompts of a batch, each counted alone
        self.token_ids = 0  # completions given as token ids: the longest one's length (already model tokens)
        self.overhead = 0
        self.media_tokens = 0
        self.n_images = 0
        self.n_videos = 0

    # chat ----------------------------------------------------------------------------------------------------
    def chat(self, body: dict[str, Any]) -> None:
        messages = _required_list(body, "messages", _MESSAGES_SHAPE)
        self._tools(body)
        documents = body.get("documents")
        if isinstance(documents, list) and documents:
            self._json(documents)
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise _bad_type(("messages", i), 'an object such as {"role": "user", "content": "Hi"}')
            role = message.get("role")
            if not isinstance(role, str) or not role:
                raise _bad_role(("messages", i, "role"), role, "'system', 'user', 'assistant' or 'tool'")
            self.overhead += MESSAGE_OVERHEAD_TOKENS
            content = message.get("content")
            if isinstance(content, str):
                self.texts.append(content)
            elif isinstance(content, list):
                self._parts(content, ("messages", i, "content"))
            elif content is not None:
                raise _bad_type(("messages", i, "content"), "a string or a list of content parts")
            elif role not in ("assistant", "function"):
                raise RequestRejected(
                    f"messages[{i}] (role {role!r}) has no content; give it a string or a list of content parts.",
                    param=f"messages[{i}].content",
                    code="missing_required_parameter",
                )
            name = message.get("name")
            if isinstance(name, str):
                self.texts.append(name)
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise _bad_type(("messages", i, "reasoning"), "a string")
                self.texts.append(reasoning)
            tool_calls = message.get("tool_calls")
            if tool_calls is not None:
                self._chat_tool_calls(tool_calls, i)

    def _chat_tool_calls(self, tool_calls: Any, i: int) -> None:
        if not isinstance(tool_calls, list):
            raise _bad_type(("messages", i, "tool_calls"), "a list of tool calls")
        for j, call in enumerate(tool_calls):
            if not isinstance(call, dict):
                raise _bad_type(("messages", i, "tool_calls", j), 'an object with "function": {"name", "arguments"}')
            function = call.get("function")
            if not isinstance(function, dict):
                raise _bad_type(("messages", i, "tool_calls", j, "function"), 'an object with "name" and "arguments"')
            name = function.get("name")
            if not isinstance(name, str):
                raise _bad_type(("messages", i, "tool_calls", j, "function", "name"), "a string")
            self.overhead += TOOL_CALL_OVERHEAD_TOKENS
            self.texts.append(name)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                self.texts.append(arguments)
            elif arguments is not None:
                self._json(arguments)

    def _tools(self, body: dict[str, Any]) -> None:
        tools = body.get("tools")
        if tools is None:
            return
        if not isinstance(tools, list):
            raise _bad_type(("tools",), "a list of tool definitions")
        if tools:
            self.overhead += TOOLS_OVERHEAD_TOKENS
            self._json(tools)

    # completions ---------------------------------------------------------------------------------------------
    def completions(self, body: dict[str, Any]) -> None:
        """A prompt, or a batch of prompts (each its own request: the largest decides), as text or token ids."""
        prompt = body.get("prompt")
        shape = "a string, a list of strings, or a list of token ids"
        if prompt is None:
            raise _missing("prompt", shape)
        if isinstance(prompt, str):
            batch: list[Any] = [prompt]
        elif isinstance(prompt, list):
            batch = [prompt] if prompt and all(_is_token_id(x) for x in prompt) else prompt
        else:
            raise _bad_type(("prompt",), shape)
        if not batch or batch == [""]:
            raise _empty("prompt", "Send the text to complete.")
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise _bad_type(("suffix",), "a string")
        for j, item in enumerate(batch):
            if not item and isinstance(item, (str, list)):
                raise _empty(f"prompt[{j}]" if len(batch) > 1 or isinstance(prompt, list) else "prompt",
                             "Every prompt of a batch needs text or token ids.")
            if isinstance(item, str):
                self.alternatives.append(item + suffix if suffix else item)
            elif isinstance(item, list) and all(_is_token_id(x) for x in item):
                self.token_ids = max(self.token_ids, len(item))
            else:
                raise _bad_type(("prompt", j), "a string or a list of token ids")

    # Responses -----------------------------------------------------------------------------------------------
    def responses(self, body: dict[str, Any]) -> None:
        items = body.get("input")
        instructions = body.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise _bad_type(("instructions",), "a string")
            self.overhead += MESSAGE_OVERHEAD_TOKENS
            self.texts.append(instructions)
        self._tools(body)
        if items is None:
            raise _missing("input", "a string or a list of input items")
        if isinstance(items, str):
            if not items:
                raise _empty("input", "Send the user's input.")
            self.overhead += MESSAGE_OVERHEAD_TOKENS
            self.texts.append(items)
            return
        if not isinstance(items, list):
            raise _bad_type(("input",), "a string or a list of input items")
        if not items:
            raise _empty("input", "Send at least one input item.")
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise _bad_type(("input", i), 'an object such as {"role": "user", "content": "Hi"}')
            kind = item.get("type")
            if kind is not None and not isinstance(kind, str):
                raise _bad_type(("input", i, "type"), "a string")
            if kind is None or kind == "message":
                self._responses_message(item, i)
            elif kind == "function_call":
                self.overhead += TOOL_CALL_OVERHEAD_TOKENS
                for key in ("name", "arguments"):
                    value = item.get(key)
                    if not isinstance(value, str):
                        raise _bad_type(("input", i, key), "a string")
                    self.texts.append(value)
            elif kind == "function_call_output":
                self.overhead += MESSAGE_OVERHEAD_TOKENS
                output = item.get("output")
                if isinstance(output, str):
                    self.texts.append(output)
                elif isinstance(output, list):
                    self._parts(output, ("input", i, "output"))
                else:
                    raise _bad_type(("input", i, "output"), "a string or a list of content parts")
            elif kind == "reasoning":
                for key in ("summary", "content"):
                    parts = item.get(key)
                    if isinstance(parts, list):
                        for part in parts:
                            if isinstance(part, dict) and isinstance(part.get("text"), str):
                                self.texts.append(part["text"])
            elif kind == "item_reference":
                continue  # a stored item: its size is unknown here
            else:  # other item kinds (tool outputs of built-in tools...): count what they carry
                self.overhead += MESSAGE_OVERHEAD_TOKENS
                self._json(item)

    def _responses_message(self, item: dict[str, Any], i: int) -> None:
        role = item.get("role")
        if not isinstance(role, str) or not role:
            raise _bad_role(("input", i, "role"), role, "'user', 'assistant', 'system' or 'developer'")
        self._message_content(item, "input", i, "content parts", role)

    # Anthropic messages --------------------------------------------------------------------------------------
    def anthropic(self, body: dict[str, Any]) -> None:
        messages = _required_list(body, "messages", _MESSAGES_SHAPE)
        system = body.get("system")
        if isinstance(system, str):
            self.overhead += MESSAGE_OVERHEAD_TOKENS
            self.texts.append(system)
        elif isinstance(system, list):
            self.overhead += MESSAGE_OVERHEAD_TOKENS
            self._parts(system, ("system",))
        elif system is not None:
            raise _bad_type(("system",), "a string or a list of text blocks")
        self._tools(body)
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise _bad_type(("messages", i), 'an object such as {"role": "user", "content": "Hi"}')
            role = message.get("role")
            if role not in ("user", "assistant"):
                raise _bad_role(("messages", i, "role"), role, "'user' or 'assistant' (put system text in `system`)")
            self._message_content(message, "messages", i, "content blocks")

    def _message_content(self, message: dict[str, Any], field: str, i: int, parts: str,
                         role: str | None = None) -> None:
        """A Responses or Anthropic message's required content: a string or a list of `parts` (the API's word).
        `role`, when given, is named in the error for missing content."""
        self.overhead += MESSAGE_OVERHEAD_TOKENS
        content = message.get("content")
        if isinstance(content, str):
            self.texts.append(content)
        elif isinstance(content, list):
            self._parts(content, (field, i, "content"))
        elif content is None:
            who = f"{field}[{i}]" if role is None else f"{field}[{i}] (role {role!r})"
            raise RequestRejected(
                f"{who} has no content; give it a string or a list of {parts}.",
                param=f"{field}[{i}].content",
                code="missing_required_parameter",
            )
        else:
            raise _bad_type((field, i, "content"), f"a string or a list of {parts}")

    # content parts (all APIs) --------------------------------------------------------------------------------
    def _parts(self, parts: list[Any], loc: Loc, nested: bool = False) -> None:
        for j, part in enumerate(parts):
            if isinstance(part, str):  # some clients send bare strings in content lists
                self.texts.append(part)
                continue
            if not isinstance(part, dict):
                raise _bad_type((*loc, j), 'a content part such as {"type": "text", "text": "Hi"}')
            kind = part.get("type")
            if not isinstance(kind, str):
                raise RequestRejected(
                    f"{_dotted((*loc, j))} needs a string `type` such as 'text' or 'image_url'.",
                    param=_dotted((*loc, j, "type")),
                    code="missing_required_parameter" if kind is None else "invalid_type",
                )
            if kind in _TEXT_PARTS:
                text = part.get("text")
                if not isinstance(text, str):
                    raise _bad_type((*loc, j, "text"), "a string")
                self.texts.append(text)
            elif kind in _IMAGE_PARTS:
                self._image(part, kind, (*loc, j))
            elif kind == "video_url":
                self._video(part, (*loc, j))
            elif kind == "tool_use":
                name = part.get("name")
                if not isinstance(name, str):
                    raise _bad_type((*loc, j, "name"), "a string")
                self.overhead += TOOL_CALL_OVERHEAD_TOKENS
                self.texts.append(name)
                if part.get("input") is not None:
                    self._json(part["input"])
            elif kind == "tool_result" and not nested:
                self.overhead += MESSAGE_OVERHEAD_TOKENS
                content = part.get("content")
                if isinstance(content, str):
                    self.texts.append(content)
                elif isinstance(content, list):
                    self._parts(content, (*loc, j, "content"), nested=True)
                elif content is not None:
                    raise _bad_type((*loc, j, "content"), "a string or a list of content blocks")
            elif kind == "document":
                self._document(part, (*loc, j), nested)
            elif kind == "thinking":
                thinking = part.get("thinking")
                if isinstance(thinking, str):
                    self.texts.append(thinking)
            elif kind == "refusal":
                refusal = part.get("refusal")
                if isinstance(refusal, str):
                    self.texts.append(refusal)
            elif kind == "redacted_thinking":
                continue  # encrypted by another provider: the template cannot render it
            elif kind in _AUDIO_PARTS:
                raise RequestRejected(
                    f"{_dotted((*loc, j))} is audio, which MiniMax-M3 does not accept; send text, images or video.",
                    param=_dotted((*loc, j)),
                    code="unsupported_modality",
                )
            else:  # a part kind this gateway does not know: count what it carries rather than refuse it
                self._json(part)

    def _image(self, part: dict[str, Any], kind: str, loc: Loc) -> None:
        """An image's tokens from its pixel size when it is inline base64, else the configured default."""
        cfg = self.cfg
        size: tuple[int, int] | None = None
        if kind == "image":  # Anthropic: {"source": {"type": "base64", "data": ...} | {"type": "url", "url": ...}}
            source = part.get("source")
            if not isinstance(source, dict):
                raise _bad_type((*loc, "source"), 'an object such as {"type": "base64", "data": ...}')
            data = source.get("data")
            if source.get("type") == "base64":
                if not isinstance(data, str):
                    raise _bad_type((*loc, "source", "data"), "a base64 string")
                size = image_size_from_base64(data)
            elif isinstance(source.get("url"), str) and source["url"].startswith("data:"):
                size = _data_url_size(source["url"])
        else:
            url = _url_of(part, kind, loc)
            if url.startswith("data:"):
                size = _data_url_size(url)
        self.n_images += 1
        if size is None:
            self.media_tokens += cfg.image_tokens_default
        else:
            self.media_tokens += image_tokens(size[0], size[1], cfg.image_patch_pixels, cfg.image_tokens_max)

    def _video(self, part: dict[str, Any], loc: Loc) -> None:
        _url_of(part, "video_url", loc)
        self.n_videos += 1
        self.media_tokens += self.cfg.video_tokens_default

    def _document(self, part: dict[str, Any], loc: Loc, nested: bool) -> None:
        source = part.get("source")
        if not isinstance(source, dict):
            raise _bad_type((*loc, "source"), 'an object such as {"type": "text", "data": ...}')
        self.overhead += MESSAGE_OVERHEAD_TOKENS
        for key in ("title", "context"):
            value = part.get(key)
            if isinstance(value, str):
                self.texts.append(value)
        kind = source.get("type")
        if kind == "text":
            data = source.get("data")
            if not isinstance(data, str):
                raise _bad_type((*loc, "source", "data"), "a string")
            self.texts.append(data)
        elif kind == "content" and isinstance(source.get("content"), (str, list)) and not nested:
            content = source["content"]
            if isinstance(content, str):
                self.texts.append(content)
            else:
                self._parts(content, (*loc, "source", "content"), nested=True)
        else:
            raise RequestRejected(
                f"{_dotted((*loc, 'source'))}: only text documents (source type 'text' or 'content') can be read "
                "by MiniMax-M3 here; extract the document's text and send that.",
                param=_dotted((*loc, "source")),
                code="unsupported_modality",
            )

    def _json(self, value: Any) -> None:
        """Count a structure as the JSON text a template renders it as (tool schemas, tool arguments)."""
        try:
            self.texts.append(orjson.dumps(value).decode())
        except (orjson.JSONEncodeError, TypeError):  # ints beyond 64 bits, nesting beyond orjson's limit
            self.texts.append(_loose_json(value))


# ---------------------------------------------------------------------------------------------------------------
# Helpers


def _url_of(part: dict[str, Any], kind: str, loc: Loc) -> str:
    """The URL of an image_url / video_url / input_image part: {"image_url": {"url": u}} or {"image_url": u}."""
    value = part.get(kind)
    if kind == "input_image" and value is None:
        value = part.get("image_url")
        if value is None and isinstance(part.get("file_id"), str):
            return ""
        field: Loc = (*loc, "image_url")
    else:
        field = (*loc, kind)
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        url = value.get("url")
        if isinstance(url, str):
            return url
        field = (*field, "url")
    raise RequestRejected(
        f"{_dotted(field)} must be a URL string (https://… or data:…;base64,…).",
        param=_dotted(field),
        code="missing_required_parameter" if value is None else "invalid_type",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _data_url_size(url: str) -> tuple[int, int] | None:
    start = base64_payload_start(url)
    return None if start is None else image_size_from_base64(url, start)


def _loose_json(value: Any) -> str:
    """A JSON-ish rendering that never fails: used only where orjson refuses (huge ints, very deep nesting)."""
    parts: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                parts.append(f'"{key}":')
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)
        else:
            # str() refuses ints of more than 4300 digits; their exact digits do not matter for a count
            parts.append("9" * 64 if isinstance(item, int) and item.bit_length() > 14_000 else str(item))
    return ",".join(parts)


def _required_list(body: dict[str, Any], name: str, shape: str) -> list[Any]:
    value = body.get(name)
    if value is None:
        raise _missing(name, shape)
    if not isinstance(value, list):
        raise _bad_type((name,), shape)
    if not value:
        raise _empty(name, "Send at least one message.")
    return value


def _dotted(loc: Loc) -> str:
    """("messages", 3, "content") → "messages[3].content"."""
    out = ""
    for key in loc:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
    return out


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value[:40] + ("…" if len(value) > 40 else ""))
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a {_json_kind(value)}"


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {dict: "object", list: "list", str: "string", type(None): "null"}.get(type(value), type(value).__name__)


def _bad_type(loc: Loc, expected: str) -> RequestRejected:
    where = _dotted(loc)
    return RequestRejected(f"{where} must be {expected}.", param=where, code="invalid_type")


def _bad_role(loc: Loc, role: Any, expected: str) -> RequestRejected:
    where = _dotted(loc)
    if role is None:
        return RequestRejected(f"{where} is missing; use {expected}.", param=where, code="missing_required_parameter")
    return RequestRejected(f"{where} must be {expected}; got {_show(role)}.", param=where, code="invalid_type")


def _missing(name: str, shape: str) -> RequestRejected:
    return RequestRejected(f"Missing required parameter `{name}`: send {shape}.", param=name,
                           code="missing_required_parameter")


def _empty(name: str, advice: str) -> RequestRejected:
    return RequestRejected(f"`{name}` is empty. {advice}", param=name, code="invalid_value")

