"""Session identity: which agent session a request belongs to, from what the client sent. Pure, no I/O.

Agent clients name their sessions in different places, so the first match wins, most specific first:

1. headers: `x-session-id` (OpenCode), `x-dynamo-session-id`, `x-litellm-session-id`, `helicone-session-id`,
   `x-claude-code-session-id` (plus `x-claude-code-agent-id` for a sub-agent), `session-id` (Codex);
2. body: `session_id`, `metadata.session_id`, then `user` (strings only).

Parent links come from `x-parent-session-id` / `x-dynamo-parent-session-id`; `x-dynamo-session-final: true` says the
request is the session's last. Ids longer than `MAX_ID_CHARS` are replaced by a short stable hash, so what the gateway
keeps per session is bounded whatever a client sends. Ids are client data: telemetry must show them only through
`redacted`.

When a client names no session, the store (pools/sessions.py) infers one from two clues computed here:

- tool-call ids: a request carrying results for tool calls m3gate returned in an earlier answer continues that
  answer's session (`tool_result_ids` in requests; `answer_tool_call_ids` / `SseToolCallScanner` in answers);
- history: a request's history up to its last assistant turn is exactly the previous request's whole history
  (`history_keys`), so the previous request registers a hash of its history and the next one looks it up.

Never raises on odd JSON (wrong types, missing keys): an unreadable clue is no clue.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

__all__ = [
    "API_KINDS",
    "BODY_FIELDS",
    "ID_SOURCES",
    "MAX_ID_CHARS",
    "PARENT_HEADERS",
    "SESSION_HEADERS",
    "TURN_KINDS",
    "SessionIdentity",
    "SseToolCallScanner",
    "answer_tool_call_ids",
    "cap_id",
    "history_keys",
    "identify",
    "redacted",
    "tool_result_ids",
    "turn_facts",
    "turn_kind",
]

API_KINDS = ("chat", "completions", "responses", "messages")
ID_SOURCES = ("header", "body", "tool_call", "history", "none")
TURN_KINDS = ("first", "user", "tool_result")

SESSION_HEADERS = (
    "x-session-id",  # OpenCode
    "x-dynamo-session-id",
    "x-litellm-session-id",
    "helicone-session-id",
    "x-claude-code-session-id",
    "session-id",  # Codex
)
AGENT_HEADER = "x-claude-code-agent-id"
PARENT_HEADERS = ("x-parent-session-id", "x-dynamo-parent-session-id")
FINAL_HEADER = "x-dynamo-session-final"
BODY_FIELDS = ("session_id", "metadata.session_id", "user")

MAX_ID_CHARS = 128
_CAPPED_PREFIX = "~"  # a capped id reads "~" + 32 hex digits; a client's own id rarely starts so


@dataclass(slots=True)
class SessionIdentity:
    """What the request itself says about its session. `id` is None when it says nothing (`id_source` "none");
    the store then infers one and reports "tool_call", "history" or "none" (a new session)."""

    id: str | None = None
    id_source: str = "none"
    parent_id: str | None = None
    agent_id: str | None = None
    final: bool = False


NOBODY = SessionIdentity()  # what `identify` returns for a request that names nothing; shared, never mutated


def cap_id(value: str, max_chars: int = MAX_ID_CHARS) -> str:
    """`value`, or a stable 33-character stand-in when it is longer than `max_chars` (bounded memory per id; the
    same long id always maps to the same stand-in, on every gateway)."""
    if len(value) <= max_chars:
        return value
    return _CAPPED_PREFIX + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def redacted(value: str, key: bytes | None = None, length: int = 16) -> str:
    """What telemetry may show for a session id (`session.id` when configured to hash): the leading hex digits of
    its SHA-256, or of its HMAC-SHA-256 under `key` so that ids cannot be confirmed by guessing without the key."""
    data = value.encode("utf-8", "surrogatepass")
    digest = hmac.new(key, data, hashlib.sha256).hexdigest() if key else hashlib.sha256(data).hexdigest()
    return digest[:length]


def _clean(value: object, max_chars: int) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    return cap_id(value, max_chars) if value else None


def identify(headers: Mapping[str, str], body: Mapping[str, Any], api: str,
             max_chars: int = MAX_ID_CHARS) -> SessionIdentity:
    """The session the request names (headers first, then body; see the module docstring). `headers` must be
    case-insensitive (Starlette's `Headers`) or hold lower-case names."""
    if not headers and "session_id" not in body and "metadata" not in body and "user" not in body:
        return NOBODY  # the common case, a request that says nothing: no object to build
    get = headers.get
    identity = SessionIdentity()
    for name in SESSION_HEADERS if headers else ():
        value = _clean(get(name), max_chars)
        if value is not None:
            identity.id, identity.id_source = value, "header"
            break
    if identity.id is None:
        value = _clean(body.get("session_id"), max_chars)
        if value is None:
            metadata = body.get("metadata")
            if isinstance(metadata, dict):
                value = _clean(metadata.get("session_id"), max_chars)
        if value is None:
            value = _clean(body.get("user"), max_chars)
        if value is not None:
            identity.id, identity.id_source = value, "body"
    if not headers:
        return identity
    agent = get(AGENT_HEADER)
    if agent is not None:
        identity.agent_id = _clean(agent, max_chars)
    for name in PARENT_HEADERS:
        parent = _clean(get(name), max_chars)
        if parent is not None:
            identity.parent_id = parent
            break
    final = get(FINAL_HEADER)
    if final is not None and final.strip().lower() in ("true", "1", "yes"):
        identity.final = True
    return identity


# -- the conversation, per API -----------------------------------------------------------------------------------
# Each API is read as a list of items, each either produced by the model ("assistant" items) or not. Chat and
# Anthropic items are messages; Responses items are messages, function calls, their outputs and reasoning.

_RESPONSES_MODEL_ITEMS = frozenset({"function_call", "reasoning", "custom_tool_call", "web_search_call",
                                    "file_search_call", "computer_call", "code_interpreter_call", "mcp_call",
                                    "local_shell_call", "image_generation_call"})
_RESPONSES_RESULT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output", "computer_call_output",
                                     "local_shell_call_output", "mcp_approval_response"})


def _field(item: dict[str, Any], name: str) -> str | None:
    """A string field, or None: odd JSON may put a list where a type name belongs (and a list is unhashable)."""
    value = item.get(name)
    return value if isinstance(value, str) else None


def _items(body: Mapping[str, Any], api: str) -> Sequence[Any]:
    key = "input" if api == "responses" else "messages"
    items = body.get(key)
    if isinstance(items, list):
        return items
    if api == "responses" and isinstance(items, str):
        return ({"role": "user", "content": items},)
    return ()


def _is_model_item(item: Any, api: str) -> bool:
    if not isinstance(item, dict):
        return False
    if api == "responses":
        kind = _field(item, "type")
        if kind in _RESPONSES_MODEL_ITEMS:
            return True
        return item.get("role") == "assistant" and kind in (None, "message")
    return item.get("role") == "assistant"


def _result_ids(item: Any, api: str) -> list[str] | None:
    """The tool-call ids `item` carries results for, or None when it is not a tool result."""
    if not isinstance(item, dict):
        return None
    if api == "chat":
        if item.get("role") != "tool":
            return None
        call_id = item.get("tool_call_id")
        return [call_id] if isinstance(call_id, str) and call_id else []
    if api == "responses":
        if _field(item, "type") not in _RESPONSES_RESULT_ITEMS:
            return None
        call_id = item.get("call_id")
        return [call_id] if isinstance(call_id, str) and call_id else []
    if api == "messages":
        content = item.get("content")
        if item.get("role") != "user" or not isinstance(content, list):
            return None
        ids = [block.get("tool_use_id") for block in content
               if isinstance(block, dict) and block.get("type") == "tool_result"]
        if not ids:
            return None
        return [i for i in ids if isinstance(i, str) and i]
    return None


_USER_ROLES = frozenset({"user", "system", "developer"})


def _trailing_results(body: Mapping[str, Any], api: str) -> tuple[tuple[str, ...], bool]:
    """(ids, whether any tool result ends the request): see `tool_result_ids`."""
    if api not in ("chat", "responses", "messages"):
        return (), False
    out: list[str] = []
    found = False
    for item in reversed(_items(body, api)):
        ids = _result_ids(item, api)
        if ids is not None:
            found = True
            out.extend(reversed(ids))
            if api == "messages":  # Anthropic carries all of a turn's results in one user message
                break
            continue
        if not isinstance(item, dict):
            break
        if api == "responses" and _field(item, "type") in _RESPONSES_MODEL_ITEMS:
            continue  # the calls these results answer, or reasoning, between parallel results
        if not found and _field(item, "role") in _USER_ROLES:
            continue  # a note the agent appends after the results (a reminder, a screenshot)
        break
    return tuple(out), found


def tool_result_ids(body: Mapping[str, Any], api: str) -> tuple[str, ...]:
    """The tool-call ids whose results end the request (the trailing results, newest first, past any user note the
    agent appended after them): those answer the latest assistant turn, the one most likely still remembered. Walks
    back from the end only, so a long history costs nothing. Responses: the model's own items (its function calls,
    reasoning) between results are skipped."""
    return _trailing_results(body, api)[0]


def turn_kind(body: Mapping[str, Any], api: str) -> str:
    """"tool_result" when the request ends with tool results (a note after them allowed), "first" when its history
    has no assistant turn, "user" otherwise (a person or an agent loop spoke after an answer)."""
    return turn_facts(body, api)[0]


def turn_facts(body: Mapping[str, Any], api: str) -> tuple[str, tuple[str, ...]]:
    """(turn_kind, tool_result_ids) in one walk of the request's tail."""
    ids, found = _trailing_results(body, api)
    if found:
        return "tool_result", ids
    if api == "completions" or not any(_is_model_item(item, api) for item in _items(body, api)):
        return "first", ids
    return "user", ids


def turn_facts_and_keys(body: Mapping[str, Any], api: str,
                        scope: str = "") -> tuple[str, tuple[str, ...], int | None, int]:
    """`turn_facts` and `history_keys` together, for a request that names no session (it is found by these): the
    history walk already knows whether there is a model item, so the turn kind costs no second walk."""
    ids, found = _trailing_results(body, api)
    lookup, register, boundary = _history(body, api, scope)
    kind = "tool_result" if found else "first" if api == "completions" or boundary < 0 else "user"
    return kind, ids, lookup, register


# -- history keys ------------------------------------------------------------------------------------------------

_DROPPED_PART_KEYS = ("cache_control",)  # moves between turns (Anthropic prompt caching); not conversation
_SKIPPED_PARTS = frozenset({"thinking", "redacted_thinking"})  # clients may or may not echo them back
_dumps = orjson.dumps
_SORT = orjson.OPT_SORT_KEYS


def _content(content: Any) -> Any:
    """Content as the next turn will send it again: cache markers and thinking dropped, a list of text parts
    joined (some clients send a string one turn and `[{"type": "text"}]` the next)."""
    if not isinstance(content, list):
        return content
    parts: list[Any] = []
    texts: list[str] | None = []
    for part in content:
        if isinstance(part, dict):
            if _field(part, "type") in _SKIPPED_PARTS:
                continue
            if any(k in part for k in _DROPPED_PART_KEYS):
                part = {k: v for k, v in part.items() if k not in _DROPPED_PART_KEYS}
            if texts is not None:
                text = part.get("text")
                if part.get("type") in ("text", "input_text", "output_text") and isinstance(text, str) \
                        and len(part) == 2:
                    texts.append(text)
                else:
                    texts = None
        else:
            texts = None
        parts.append(part)
    return "".join(texts) if texts is not None else parts


def _tool_calls(calls: Any) -> Any:
    """Only what identifies a call (id, name, arguments): clients differ in the extra fields they echo back."""
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        if isinstance(call, dict):
            function = call.get("function")
            if isinstance(function, dict):
                function = (function.get("name"), function.get("arguments"))
            out.append((call.get("id"), function))
        else:
            out.append(call)
    return out


def _canonical(item: Any, api: str) -> bytes:
    """One history item as bytes, stable across the turns that re-send it."""
    if not isinstance(item, dict):
        return _dumps(item, option=_SORT)
    if api == "responses" and item.get("type") not in (None, "message"):
        kind = item.get("type")
        if kind == "reasoning":
            return b""
        return _dumps({k: v for k, v in item.items() if k not in ("id", "status")}, option=_SORT)
    content = item.get("content")
    if type(content) is list:
        content = _content(content)
    if api == "chat":  # a tuple, not a dict: ~40% faster to serialise, and the order is fixed anyway
        calls = item.get("tool_calls")
        return _dumps((item.get("role"), content, _tool_calls(calls) if calls else None, item.get("tool_call_id")),
                      option=_SORT)
    return _dumps((item.get("role"), content), option=_SORT)


def _seed(scope: str) -> int:
    return xxhash.xxh3_64_intdigest(scope.encode("utf-8", "surrogatepass")) if scope else 0


def history_keys(body: Mapping[str, Any], api: str, scope: str = "") -> tuple[int | None, int]:
    """(lookup_key, register_key) of a request's conversation, as 64-bit integers.

    register_key hashes the whole history: the next turn re-sends exactly this before its next assistant item.
    lookup_key hashes the history before the last run of assistant items (None if there is none), so it equals the
    previous turn's register_key: turn 2 = [sys, u1, A1, u2] looks up H([sys, u1]), which turn 1 registered. The
    system prompt (Chat's system message, Responses' `instructions`, Anthropic's `system`) counts as the first item.
    `scope` (e.g. the API key's id) keeps two tenants' identical openings apart."""
    lookup, register, _ = _history(body, api, scope)
    return lookup, register


def _history(body: Mapping[str, Any], api: str, scope: str) -> tuple[int | None, int, int]:
    """history_keys' (lookup_key, register_key), and the index where the last run of model items starts (-1: none)."""
    state = xxhash.xxh3_64(seed=_seed(scope)) if scope else xxhash.xxh3_64()
    update = state.update
    items = _items(body, api) if api != "completions" else ()
    system = body.get("instructions") if api == "responses" else body.get("system") if api == "messages" else None
    if system is not None:
        update(_dumps(("system", _content(system)), option=_SORT))
    elif api == "completions":
        prompt = body.get("prompt")
        update(_dumps(prompt, option=_SORT) if not isinstance(prompt, str) else prompt.encode("utf-8", "replace"))
    # the last run of model items: [boundary, end) ... everything before `boundary` is the lookup history
    boundary = -1
    for i in range(len(items) - 1, -1, -1):
        if _is_model_item(items[i], api):
            boundary = i
            while boundary > 0 and _is_model_item(items[boundary - 1], api):
                boundary -= 1
            break
    lookup: int | None = None
    for i, item in enumerate(items):
        if i == boundary and (i > 0 or system is not None):  # an empty history would match every other empty one
            lookup = state.intdigest()
        update(_canonical(item, api))
    return lookup, state.intdigest(), boundary


# -- tool-call ids in answers --------------------------------------------------------------------------------------

_MARKERS = {"chat": b'"tool_calls"', "responses": b'"function_call"', "messages": b'"tool_use"'}


def _ids_from(obj: Any, api: str, streamed: bool) -> list[str]:
    """Tool-call ids in one parsed answer (`streamed=False`) or one parsed SSE event's data."""
    out: list[str] = []
    if not isinstance(obj, dict):
        return out
    if api == "chat":
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            message = choice.get("delta" if streamed else "message")
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            for call in calls if isinstance(calls, list) else ():
                if isinstance(call, dict) and isinstance(call.get("id"), str) and call["id"]:
                    out.append(call["id"])
    elif api == "responses":
        if streamed:
            items = [obj.get("item")] if obj.get("type") in ("response.output_item.added",
                                                             "response.output_item.done") else []
        else:
            items = obj.get("output") if isinstance(obj.get("output"), list) else []
        for item in items:
            if isinstance(item, dict) and item.get("type") == "function_call" \
                    and isinstance(item.get("call_id"), str) and item["call_id"]:
                out.append(item["call_id"])
    elif api == "messages":
        blocks = [obj.get("content_block")] if streamed else obj.get("content")
        for block in blocks if isinstance(blocks, list) else ():
            if isinstance(block, dict) and block.get("type") == "tool_use" \
                    and isinstance(block.get("id"), str) and block["id"]:
                out.append(block["id"])
    return out


def answer_tool_call_ids(body: bytes, api: str) -> tuple[str, ...]:
    """The tool-call ids a non-streamed answer asks results for (a bytes check first: most answers parse never)."""
    marker = _MARKERS.get(api)
    if marker is None or marker not in body:
        return ()
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ()
    return tuple(dict.fromkeys(_ids_from(obj, api, streamed=False)))


class SseToolCallScanner:
    """Collects the tool-call ids of a streamed answer as its bytes pass, without slowing the relay.

    Per chunk the common case is two bytes checks: the chunk ends an event, and the API's marker (`"tool_calls"`,
    `"function_call"`, `"tool_use"`) is not in it. Only when a chunk ends mid-event is its tail kept (so an event or a
    marker split across chunks is seen whole), and only events that contain the marker are parsed. Feed it the raw
    upstream chunks, in order; read `ids` at the end.
    """

    __slots__ = ("_carry", "_ids", "_marker", "api", "max_carry", "overflowed")

    def __init__(self, api: str, max_carry: int = 1 << 16) -> None:
        self.api = api
        self._marker = _MARKERS.get(api)
        self._carry = b""
        self._ids: dict[str, None] = {}
        self.max_carry = max_carry  # a longer event is content, not the start of a tool call: dropped
        self.overflowed = 0

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self._ids)

    def feed(self, chunk: bytes) -> None:
        marker = self._marker
        if marker is None:
            return
        if self._carry:
            chunk = self._carry + chunk
            self._carry = b""
        if not chunk.endswith(b"\n\n"):
            cut = chunk.rfind(b"\n\n")
            cut = cut + 2 if cut >= 0 else 0  # no boundary at all: the whole chunk is carried
            tail = chunk[cut:]
            if len(tail) > self.max_carry:
                self.overflowed += 1
            else:
                self._carry = tail
            chunk = chunk[:cut]
        if marker in chunk:
            self._scan(chunk)

    def _scan(self, complete: bytes) -> None:
        marker, api, ids = self._marker, self.api, self._ids
        assert marker is not None
        for event in complete.split(b"\n\n"):
            if marker not in event:
                continue
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                try:
                    obj = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    continue
                for call_id in _ids_from(obj, api, streamed=True):
                    ids[call_id] = None
