"""MiniMax-M3's raw output text back into chat deltas, as vLLM 0.32's M3 reasoning and tool parsers give them.

A resumed chat stream continues through `/v1/completions` (token ids in, raw text out: no parser runs there), so the
gateway splits the raw continuation itself, starting from the state the client's stream was in at the cut:

- reasoning ends at `</mm:think>`; only the answer's first `<mm:think>` is a marker, a later one is text (vLLM's
  parser partitions the answer at the first one: the tiny test model repeats the marker inside its reasoning);
- content turns into reasoning at the answer's first `<mm:think>`, into tool calls at `]<]minimax[>[<tool_call>`;
- in the tool block each `]<]minimax[>[<invoke name="…">` announces a call (id, name), and its parameters are
  converted to JSON once `]<]minimax[>[</invoke>` closes it (vLLM's `stream_arg_deltas=False`), typed by the tool's
  schema as vLLM's `parser/minimax_m3.py` does; text after `]<]minimax[>[</tool_call>` is dropped.

Text that may be the start of a marker is held back until the next piece decides it. `suppress_*` drop output the
client already saw (a rolled-back chunk regenerated); `announced` tool calls are not announced twice.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, replace
from typing import Any

NAMESPACE = "]<]minimax[>["
THINK_START, THINK_END = "<mm:think>", "</mm:think>"
TOOL_START, TOOL_END = NAMESPACE + "<tool_call>", NAMESPACE + "</tool_call>"
INVOKE_PREFIX, INVOKE_END = NAMESPACE + "<invoke name=", NAMESPACE + "</invoke>"
ELEMENT_START, ELEMENT_END_START = NAMESPACE + "<", NAMESPACE + "</"
MAX_DEPTH = 128
Mode = str  # "reasoning" | "content" | "tools" (between invokes) | "invoke" | "done" (after the tool block)


@dataclass(frozen=True, slots=True)
class ParserState:
    """Where the parser is: a value, so a clean point of a stream can be kept and resumed from."""

    mode: Mode = "content"
    buffer: str = ""  # raw text held back (a possible marker start, or an unfinished invoke)
    tool_index: int = 0  # the next tool call's index
    invoke_name: str = ""  # the call being read (mode "invoke")
    suppress_reasoning: int = 0  # characters of reasoning output the client already has
    suppress_content: int = 0
    announced: int = 0  # upcoming tool calls whose id and name the client already has
    tools_called: bool = False  # a tool call was announced (the chat finish_reason becomes "tool_calls")
    think_seen: bool = False  # the answer's `<mm:think>` marker is behind: a later one is text


def initial_state(thinking_mode: Any) -> ParserState:
    """vLLM's M3 reasoning parser starts inside reasoning only when thinking_mode is "enabled"."""
    return ParserState(mode="reasoning" if thinking_mode == "enabled" else "content")


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that could begin one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class M3StreamParser:
    """Feeds raw M3 text piece by piece; each `feed` returns the chat delta it produces ({} when nothing shows)."""

    def __init__(self, state: ParserState, tools: list[dict[str, Any]] | None = None) -> None:
        self.state = state
        self.tools = tools or []
        self._delta: dict[str, Any] = {}

    @property
    def clean(self) -> bool:
        """Nothing held back: the stream may be cut here and resumed from `state` exactly."""
        return not self.state.buffer and self.state.mode != "invoke"

    def feed(self, text: str) -> dict[str, Any]:
        self._delta = {}
        s = self.state
        buf = s.buffer + text
        while True:
            step = getattr(self, "_" + s.mode)
            s, buf, again = step(s, buf)
            if not again:
                break
        self.state = replace(s, buffer=buf)
        return self._delta

    def finish(self) -> dict[str, Any]:
        """At the end of the stream: text held back as a possible marker is text after all."""
        self._delta = {}
        s, buf = self.state, self.state.buffer
        if s.mode == "reasoning":
            s = self._emit(s, "reasoning", buf if s.think_seen else buf.replace(THINK_START, "", 1))
        elif s.mode == "content":
            s = self._emit(s, "content", buf)
        self.state = replace(s, buffer="")
        return self._delta

    # modes: each takes (state, buffer) and returns (state, rest of the buffer, whether to go on) ----------------
    def _reasoning(self, s: ParserState, buf: str) -> tuple[ParserState, str, bool]:
        # the answer's own marker may come first (thinking_mode "enabled" repeats it); vLLM honours only the first
        opening = () if s.think_seen else ((THINK_START, {"think_seen": True}),)
        return self._until(s, buf, "reasoning", (*opening, (THINK_END, {"mode": "content"})))

    def _content(self, s: ParserState, buf: str) -> tuple[ParserState, str, bool]:
        opening = () if s.think_seen else ((THINK_START, {"mode": "reasoning", "think_seen": True}),)
        return self._until(s, buf, "content", (*opening, (TOOL_START, {"mode": "tools"})))

    def _until(self, s: ParserState, buf: str, kind: str,
               markers: tuple[tuple[str, dict[str, Any]], ...]) -> tuple[ParserState, str, bool]:
        """Emits `buf` as `kind` up to the earliest of `markers` and applies that marker's change to the state;
        without one, emits all but a tail that could begin a marker (held for the next piece)."""
        found = [(at, marker, change) for marker, change in markers for at in (buf.find(marker),) if at >= 0]
        if found:
            at, marker, change = min(found, key=lambda f: f[0])
            s = self._emit(s, kind, buf[:at])
            return replace(s, **change), buf[at + len(marker):], True
        keep = _held(buf, tuple(marker for marker, _ in markers))
        s = self._emit(s, kind, buf[:len(buf) - keep])
        return s, buf[len(buf) - keep:], False

    def _tools(self, s: ParserState, buf: str) -> tuple[ParserState, str, bool]:
        invoke, end = buf.find(INVOKE_PREFIX), buf.find(TOOL_END)
        if end >= 0 and (invoke < 0 or end < invoke):
            return replace(s, mode="done"), "", False
        if invoke < 0:  # text between invokes is dropped; a possible marker start is kept
            keep = _held(buf, (INVOKE_PREFIX, TOOL_END))
            return s, buf[len(buf) - keep:], False
        start = invoke + len(INVOKE_PREFIX)
        quote = buf[start:start + 1]
        if not quote:
            return s, buf[invoke:], False
        if quote in ("'", '"'):
            close = buf.find(quote + ">", start + 1)
            name, after = buf[start + 1:close], close + 2
        else:
            close = buf.find(">", start)
            name, after = buf[start:close], close + 1
        if close < 0:
            return s, buf[invoke:], False
        s = self._announce(s, name.strip())
        return replace(s, mode="invoke", invoke_name=name.strip()), buf[after:], True

    def _invoke(self, s: ParserState, buf: str) -> tuple[ParserState, str, bool]:
        end = buf.find(INVOKE_END)
        if end < 0:
            return s, buf, False
        arguments = convert_arguments(buf[:end], tool_properties(self.tools, s.invoke_name))
        self._tool_delta({"index": s.tool_index, "function": {"arguments": arguments}})
        s = replace(s, mode="tools", invoke_name="", tool_index=s.tool_index + 1)
        return s, buf[end + len(INVOKE_END):], True

    def _done(self, s: ParserState, buf: str) -> tuple[ParserState, str, bool]:
        return s, "", False

    # output ----------------------------------------------------------------------------------------------------
    def _emit(self, s: ParserState, kind: str, text: str) -> ParserState:
        skip = s.suppress_reasoning if kind == "reasoning" else s.suppress_content
        if skip:
            cut = min(skip, len(text))
            text = text[cut:]
            s = replace(s, **{f"suppress_{kind}": skip - cut})
        if text:
            self._delta[kind] = self._delta.get(kind, "") + text
        return s

    def _announce(self, s: ParserState, name: str) -> ParserState:
        if s.announced:  # the client has this call's id and name already
            return replace(s, announced=s.announced - 1, tools_called=True)
        self._tool_delta({"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function", "index": s.tool_index,
                          "function": {"name": name}})
        return replace(s, tools_called=True)

    def _tool_delta(self, call: dict[str, Any]) -> None:
        self._delta.setdefault("tool_calls", []).append(call)


# arguments: vLLM's parser/minimax_m3.py, element by element --------------------------------------------------------
Element = str | list[tuple[str, Any]]


def tool_properties(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def _parse_element(text: str, pos: int, depth: int) -> tuple[str, Element, int] | None:
    if depth > MAX_DEPTH:
        return None
    name_start = pos + len(ELEMENT_START)
    name_end = text.find(">", name_start)
    if name_end <= name_start:
        return None
    name = text[name_start:name_end]
    if name.startswith("/") or not name.strip():
        return None
    close_tag = f"{ELEMENT_END_START}{name}>"
    pos = name_end + 1
    parts: list[str] = []
    children: list[tuple[str, Element]] = []
    while True:
        marker = text.find(NAMESPACE, pos)
        if marker < 0:
            return None
        parts.append(text[pos:marker])
        if text.startswith(close_tag, marker):
            pos = marker + len(close_tag)
            break
        if not text.startswith(ELEMENT_START, marker):
            return None
        child = _parse_element(text, marker, depth + 1)
        if child is None:
            return None
        children.append(child[:2])
        pos = child[2]
    body = "".join(parts)
    if not children:
        return name, body, pos
    if body.strip():
        field = "$text"
        while any(n == field for n, _ in children):
            field = "$" + field
        children.append((field, body))
    return name, children, pos


def parse_params(raw: str) -> list[tuple[str, Element]]:
    """The parameter elements of one invoke body, up to the first malformed one."""
    params: list[tuple[str, Element]] = []
    pos = 0
    while True:
        while pos < len(raw) and raw[pos].isspace():
            pos += 1
        if not raw.startswith(ELEMENT_START, pos):
            return params
        element = _parse_element(raw, pos, 1)
        if element is None:
            return params
        params.append(element[:2])
        pos = element[2]


def _container(schema: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    types = schema.get("type")
    for kind in ("array", "object"):
        if types == kind or (isinstance(types, list) and kind in types):
            return kind, schema
    if types is None:
        if "items" in schema:
            return "array", schema
        if "properties" in schema or "additionalProperties" in schema:
            return "object", schema
    for field in ("anyOf", "oneOf"):
        for choice in schema.get(field) or ():
            if isinstance(choice, dict) and (found := _container(choice)):
                return found
    return None


def schema_types(schema: dict[str, Any]) -> list[str]:
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, list):
        types.update(t for t in kind if isinstance(t, str))
    for value in schema.get("enum") or ():
        types.add({bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
                   dict: "object", type(None): "null"}.get(type(value), "string"))
    for field in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(field) or ():
            if isinstance(choice, dict):
                types.update(schema_types(choice))
    return list(types) if types else ["string"]


_ALIASES = {"str": "string", "text": "string", "int": "integer", "float": "number", "double": "number",
            "bool": "boolean", "dict": "object", "list": "array"}


def coerce(value: str, types: list[str]) -> Any:
    """A scalar element's text as the first schema type it parses as (vLLM's coerce_to_schema_type)."""
    wanted = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind not in wanted:
            continue
        if kind == "string":
            return value
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return number if number != int(number) else int(number)
        if kind == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            try:
                return json.loads(value)
            except ValueError:
                continue
    try:
        return json.loads(value)
    except ValueError:
        return value


def _convert(value: Element, schema: Any) -> Any:
    schema = schema if isinstance(schema, dict) else None
    container = _container(schema) if schema is not None else None
    if isinstance(value, str):
        if schema is None:
            return value
        types = schema_types(schema)
        if container is not None and "string" not in types and not value.strip():
            return [] if container[0] == "array" else {}
        return coerce(value, types)
    if container is not None and container[0] == "array":
        return [_convert(child, container[1].get("items")) for _, child in value]
    return _convert_object(value, container[1] if container is not None else None)


def _convert_object(elements: list[tuple[str, Element]], schema: dict[str, Any] | None) -> dict[str, Any]:
    properties = (schema or {}).get("properties") or {}
    additional = (schema or {}).get("additionalProperties")
    result: dict[str, Any] = {}
    repeated: set[str] = set()
    for name, element in elements:
        converted = _convert(element, properties.get(name, additional))
        if name not in result:
            result[name] = converted
        elif name in repeated:
            result[name].append(converted)
        else:
            result[name] = [result[name], converted]
            repeated.add(name)
    return result


def convert_arguments(raw: str, properties: dict[str, Any]) -> str:
    """One invoke's parameters as the JSON arguments string vLLM's M3 parser emits."""
    return json.dumps(_convert_object(parse_params(raw), {"properties": properties}), ensure_ascii=False)
