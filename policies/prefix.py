"""Prefix identity: a request's prompt as chained block hashes, so replicas that already hold its prefix can be found.

vLLM caches the KV of whole 128-token blocks, each identified by a hash chained on its parent. Tokenizing every
request just to route it is too slow on the hot path, so this module approximates the same structure without a
tokenizer:

1. The prompt is rendered canonically to bytes, in the order a chat template lays it out: system prompt, tool
   schemas, then the conversation turns; media (images, audio, video, files) are replaced by a hash of their data
   URL / URL / payload, never fetched; fields that do not reach the prompt (`cache_control`) are left out.
2. The UTF-8 bytes are cut into blocks of `block_chars` bytes (512 by default). Bytes rather than characters because
   BPE tokens cover a far steadier number of UTF-8 bytes than of characters: about 4 for English prose, 3-4 for code,
   and 3-4.5 for CJK (one 3-byte character is roughly 0.7-1 token), whereas chars-per-token swings from ~4 to ~1 between
   English and Chinese. So 512 bytes ≈ 128 tokens ≈ one vLLM block whatever the script. Token-id prompts are rendered
   as 4 bytes per id, so 512 bytes are exactly 128 tokens.
3. Only whole blocks are hashed (vLLM caches only whole blocks), with xxh3_64 chained through the seed: block k is
   hashed with seed = hash of block k-1, and block 0 with a seed derived from the model name and `cache_salt`. A
   change in block k therefore changes hash k and every later one, as in vLLM.

The exact block boundaries do not match vLLM's token boundaries; that does not matter for *identity* (two requests
sharing a rendered prefix share leading hashes), and the matched length is only used as an estimate of cached tokens.

Never raises on odd JSON (wrong types, missing keys): it renders what it can. Rejecting bad shapes is the classifier's
job, and routing must not become a second place where a request can fail.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable
from typing import Any

import orjson
import xxhash

__all__ = ["prefix_blocks", "render_prefix", "chain_hashes", "prefix_seed", "API_ALIASES"]

_hash = xxhash.xxh3_64_intdigest

# Separators that do not occur in ordinary text, so that "ab"+"c" and "a"+"bc" render differently.
_MSG = b"\x1e"  # before each turn / segment
_ROLE = b"\x1f"  # between a turn's role and its content
_PART = b"\x1d"  # between content parts and between keys of rendered objects
_MEDIA = b"\x00media:"

_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_MEDIA_PART_TYPES = frozenset(
    {
        "image_url", "input_image", "image", "image_file",
        "video_url", "video", "input_video",
        "input_audio", "audio_url", "audio",
        "file", "input_file", "document",
    }
)  # fmt: skip
_IGNORED_KEYS = frozenset({"cache_control"})  # Anthropic cache hints never reach the prompt
_MAX_DEPTH = 24

API_ALIASES: dict[str, str] = {
    "chat": "chat",
    "chat_completions": "chat",
    "chat.completions": "chat",
    "/v1/chat/completions": "chat",
    "completions": "completions",
    "/v1/completions": "completions",
    "responses": "responses",
    "/v1/responses": "responses",
    "messages": "messages",
    "anthropic": "messages",
    "/v1/messages": "messages",
}
"""API names accepted by `prefix_blocks` (the canonical ones are chat, completions, responses, messages)."""


def prefix_seed(model: str, cache_salt: Any = None) -> int:
    """The chain's starting seed: requests for another model or another cache_salt must share no block."""
    salt = cache_salt if isinstance(cache_salt, str) and cache_salt else ""
    return _hash(f"{model}\x00{salt}".encode("utf-8", "surrogatepass"))


def chain_hashes(data: bytes, seed: int, block_bytes: int = 512) -> tuple[int, ...]:
    """Chained xxh3_64 hashes of the whole `block_bytes` blocks of `data` (a partial tail block is not hashed)."""
    if block_bytes <= 0:
        return ()
    view = memoryview(data)
    full = len(data) - len(data) % block_bytes
    hashes: list[int] = []
    append = hashes.append
    parent = seed
    for start in range(0, full, block_bytes):
        parent = _hash(view[start : start + block_bytes], parent)
        append(parent)
    return tuple(hashes)


def prefix_blocks(body: dict[str, Any], api: str, model: str, block_chars: int = 512) -> tuple[int, ...]:
    """Chained hashes of the request's whole prefix blocks, seeded with the model name and `cache_salt`.

    `api` is one of API_ALIASES (chat, completions, responses, messages). `block_chars` counts UTF-8 bytes of the
    canonical rendering (see the module docstring); keep it at 4 x the replicas' block size.
    """
    if not isinstance(body, dict):
        return ()
    try:
        parts = _render_parts(body, api)
    except Exception:  # noqa: BLE001 - odd input must never fail routing; _render_parts already degrades per field
        return ()
    return _chain_parts(parts, prefix_seed(model, body.get("cache_salt")), block_chars)


def render_prefix(body: dict[str, Any], api: str) -> bytes:
    """The canonical byte rendering of the prompt that `prefix_blocks` hashes (exposed for tests and debugging)."""
    return b"".join(_render_parts(body, api))


def _render_parts(body: dict[str, Any], api: str) -> list[bytes]:
    """render_prefix's bytes as the pieces rendered, not joined (a 1M-token prompt is ~3 MB to copy)."""
    out: list[bytes] = []
    renderer = _RENDERERS.get(API_ALIASES.get(api, api))
    if renderer is not None and isinstance(body, dict):
        with contextlib.suppress(Exception):  # odd input: keep whatever was rendered before the odd field
            renderer(body, out)
    return out


# Parts at least this long are hashed where they lie; shorter ones (role markers, short turns) are gathered first.
_IN_PLACE_BYTES = 16_384


def _chain_parts(parts: list[bytes], seed: int, block_bytes: int) -> tuple[int, ...]:
    """chain_hashes(b"".join(parts), seed, block_bytes), without copying the long parts into one buffer."""
    if block_bytes <= 0:
        return ()
    if sum(map(len, parts)) < 4 * _IN_PLACE_BYTES:
        return chain_hashes(b"".join(parts), seed, block_bytes)
    hashes: list[int] = []
    pending: list[bytes] = []  # short parts not hashed yet, and the tail of the last long one
    pending_bytes = 0
    parent = seed
    for part in parts:
        if len(part) < _IN_PLACE_BYTES:
            pending.append(part)
            pending_bytes += len(part)
            continue
        head = -pending_bytes % block_bytes  # the bytes of this part that complete the pending ones' last block
        pending.append(part[:head])
        parent = _chain_into(b"".join(pending), parent, block_bytes, hashes)
        view = memoryview(part)
        whole = head + (len(part) - head) // block_bytes * block_bytes
        parent = _chain_into(view[head:whole], parent, block_bytes, hashes)
        pending = [part[whole:]]
        pending_bytes = len(part) - whole
    _chain_into(b"".join(pending), parent, block_bytes, hashes)
    return tuple(hashes)


def _chain_into(data: bytes | memoryview, parent: int, block_bytes: int, hashes: list[int]) -> int:
    """Append the chained hashes of data's whole blocks to `hashes`; returns the last (or `parent`)."""
    view = memoryview(data)
    append = hashes.append
    for start in range(0, len(data) - len(data) % block_bytes, block_bytes):
        parent = _hash(view[start : start + block_bytes], parent)
        append(parent)
    return parent


# ---------------------------------------------------------------------------------------------------------------
# Rendering helpers: each appends bytes to `out` and tolerates any JSON value.


def _utf8(text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # lone surrogates, which the stdlib json parser lets through
        return text.encode("utf-8", "surrogatepass")


def _dump(value: Any) -> bytes:
    """Sorted-key JSON of a value (tool schemas, tool calls); falls back to repr for what orjson refuses."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        pass
    try:
        return _utf8(repr(value))
    except RecursionError:  # absurdly deep nesting: mark it rather than lose the rest of the prompt
        return b"\x00deep"


def _media_ref(part: dict[str, Any]) -> bytes:
    """A media part by the hash of everything in it (data URL or URL string, detail, format), never fetched."""
    trimmed = {k: v for k, v in part.items() if k not in _IGNORED_KEYS}
    return _MEDIA + _hash(_dump(trimmed)).to_bytes(8, "little")


def _render_value(value: Any, out: list[bytes], depth: int = 0) -> None:
    """Render any JSON value: text as itself, media by hash, objects by sorted keys."""
    if isinstance(value, str):
        out.append(_utf8(value))
    elif isinstance(value, dict):
        if value.get("type") in _MEDIA_PART_TYPES:
            out.append(_media_ref(value))
        elif value.get("type") in _TEXT_PART_TYPES and isinstance(value.get("text"), str):
            out.append(_utf8(value["text"]))
        elif depth >= _MAX_DEPTH:
            out.append(_dump(value))
        else:
            for key in sorted(k for k in value if isinstance(k, str) and k not in _IGNORED_KEYS):
                out.append(_PART + _utf8(key) + b"=")
                _render_value(value[key], out, depth + 1)
    elif isinstance(value, list):
        if depth >= _MAX_DEPTH:
            out.append(_dump(value))
            return
        for i, item in enumerate(value):
            if i:
                out.append(_PART)
            _render_value(item, out, depth + 1)
    elif value is not None:
        out.append(_dump(value))


def _render_content(content: Any, out: list[bytes]) -> None:
    """Message content: a string and a list holding just that text part render the same, as templates do."""
    if isinstance(content, str):
        out.append(_utf8(content))
    elif isinstance(content, list):
        for i, part in enumerate(content):
            if i:
                out.append(b"\n")
            _render_value(part, out)
    else:
        _render_value(content, out)


def _render_turn(message: Any, out: list[bytes], role_key: str = "role") -> None:
    """One conversation turn: role, content, then any other fields (tool calls, names, ids) by sorted key."""
    out.append(_MSG)
    if not isinstance(message, dict):
        _render_value(message, out)
        return
    role = message.get(role_key)
    out.append(_utf8(role) if isinstance(role, str) else b"?")
    out.append(_ROLE)
    _render_content(message.get("content"), out)
    extra = [k for k in message if k not in ("role", "content", "type") and k not in _IGNORED_KEYS]
    if extra:
        for key in sorted(k for k in extra if isinstance(k, str)):
            out.append(_PART + _utf8(key) + b"=")
            _render_value(message[key], out)


def _render_system(text_or_parts: Any, out: list[bytes]) -> None:
    out.append(_MSG + b"system" + _ROLE)
    _render_content(text_or_parts, out)


def _render_tools(tools: Any, out: list[bytes]) -> None:
    if tools:
        out.append(_MSG + b"tools" + _ROLE)
        out.append(_dump(tools))


def _leading_system(messages: list[Any]) -> int:
    """How many messages at the start are system/developer turns (templates put tools right after them)."""
    count = 0
    for message in messages:
        if isinstance(message, dict) and message.get("role") in ("system", "developer"):
            count += 1
        else:
            break
    return count


def _render_chat(body: dict[str, Any], out: list[bytes]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = [] if messages is None else [messages]
    head = _leading_system(messages)
    for message in messages[:head]:
        _render_turn(message, out)
    _render_tools(body.get("tools"), out)
    for message in messages[head:]:
        _render_turn(message, out)


def _render_token_ids(ids: list[Any], out: list[bytes]) -> None:
    try:
        out.append(array("I", ids).tobytes())  # 4 bytes per token: 512 bytes = exactly 128 tokens
    except (TypeError, OverflowError, ValueError):
        _render_value(ids, out)


def _render_completions(body: dict[str, Any], out: list[bytes]) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            _render_token_ids(prompt, out)
            return
        prompt = first  # a batch: its requests are routed together, so the first prompt stands for them
        if isinstance(prompt, list):
            _render_token_ids(prompt, out)
            return
    if isinstance(prompt, str):
        out.append(_utf8(prompt))
    elif prompt is not None:
        _render_value(prompt, out)


def _render_responses(body: dict[str, Any], out: list[bytes]) -> None:
    instructions = body.get("instructions")
    if instructions is not None:
        _render_system(instructions, out)
    _render_tools(body.get("tools"), out)
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and previous:
        out.append(_MSG + b"previous" + _ROLE + _utf8(previous))  # the stored conversation it continues
    items = body.get("input")
    if isinstance(items, str):
        out.append(_MSG + b"user" + _ROLE + _utf8(items))
        return
    if not isinstance(items, list):
        items = [] if items is None else [items]
    for item in items:
        if isinstance(item, dict) and "role" in item and item.get("type", "message") == "message":
            _render_turn(item, out)
        else:
            out.append(_MSG)
            _render_value(item, out)


def _render_messages(body: dict[str, Any], out: list[bytes]) -> None:
    system = body.get("system")
    if system is not None:
        _render_system(system, out)
    _render_tools(body.get("tools"), out)
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = [] if messages is None else [messages]
    for message in messages:
        _render_turn(message, out)


_RENDERERS: dict[str, Callable[[dict[str, Any], list[bytes]], None]] = {
    "chat": _render_chat,
    "completions": _render_completions,
    "responses": _render_responses,
    "messages": _render_messages,
}
