"""vLLM's request and response shapes that the gateway writes or reads itself, in one place.

The gateway relays bodies byte for byte; it only builds or reads a few of vLLM's shapes on its own: the usage of an
answer (token counts, in each API's shape), the `/tokenize` body that counts a generate request's prompt exactly (and
its answer's ids), a resumed stream's chunks, usage chunk and token-id continuation request, and the prefill request
of disaggregated serving (NIXL's KV-transfer protocol, as vLLM's toy proxy
`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py` speaks it). Each copy of one of these shapes elsewhere
would drift from vLLM on its own (reference: /work/shared/reference/vllm-contract.md, sections 1, 2 and 10). It also
reads the signs of a replica shutting down (SIGTERM with `--shutdown-timeout`, docs/stream-migration.md section 5), so
the gateway drains it instead of counting its refusals as failures.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Mapping
from typing import Any, TypeGuard

import orjson

__all__ = [
    "PREFILL_KV_PARAMS",
    "SHUTDOWN_REFUSAL",
    "STREAM_DONE",
    "chat_chunk",
    "completion_chunk",
    "continuation_body",
    "event_json",
    "splice_prompt",
    "sse_event",
    "stream_usage",
    "usage_chunk",
    "connection_refused",
    "decode_body",
    "health_says_draining",
    "prefill_body",
    "refuses_new_requests",
    "tokenize_body",
    "tokenize_ids",
    "usage_counts",
    "usage_of",
]

# What a prefill request asks the KV connector for: keep the blocks for a remote decode (the toy proxy's exact dict).
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# The chat fields vLLM's /tokenize renders the prompt with, as its chat endpoint does (ChatCompletionRequest's
# template fields that the tokenize request also takes).
_TOKENIZE_CHAT_FIELDS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                         "add_special_tokens", "chat_template", "documents")


def _is_mapping(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """isinstance(value, Mapping) without the ABC check for the usual dict and None (~1 µs each otherwise)."""
    return type(value) is dict or (value is not None and isinstance(value, Mapping))


def _count(value: Any) -> int:
    return value if type(value) is int and value > 0 else 0


def usage_counts(usage: Mapping[str, Any] | None) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of an answer's usage in any of the four APIs' shapes: Chat and
    Completions (`prompt_tokens`, `prompt_tokens_details.cached_tokens`), Responses (`input_tokens`,
    `input_tokens_details.cached_tokens`), Anthropic Messages. Anthropic's `input_tokens` excludes cache reads and
    writes, so the prompt is their sum there, and the cache reads are the cached part."""
    if not _is_mapping(usage):
        return 0, 0, 0
    prompt = usage.get("prompt_tokens")
    if prompt is not None:  # Chat and Completions, the common case
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if _is_mapping(details) else 0
        return _count(prompt), _count(usage.get("completion_tokens")), cached
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        read = _count(usage.get("cache_read_input_tokens"))
        prompt = _count(usage.get("input_tokens")) + read + _count(usage.get("cache_creation_input_tokens"))
        return prompt, _count(usage.get("output_tokens")), read
    details = usage.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if _is_mapping(details) else 0
    return _count(usage.get("input_tokens")), _count(usage.get("output_tokens")), cached


def usage_of(body: bytes) -> dict[str, Any] | None:
    """The `usage` object of a complete JSON answer, if it has one."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


def tokenize_body(body: Mapping[str, Any], api: str, model: str) -> dict[str, Any] | None:
    """The /tokenize body that renders exactly the prompt the generate request `body` will (chat: its messages with
    the template fields it sets; completions: its prompt), or None for the APIs /tokenize has no form for."""
    if api == "chat":
        out: dict[str, Any] = {"model": model, "messages": body.get("messages")}
        for key in _TOKENIZE_CHAT_FIELDS:
            if key in body:
                out[key] = body[key]
        return out
    if api == "completions":
        out = {"model": model, "prompt": body.get("prompt")}
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
        return out
    return None


_TOKENS = re.compile(rb'"tokens"\s*:\s*\[')
_NOT_IDS = b"0123456789, \n"


def tokenize_ids(answer: bytes) -> bytes | None:
    """The ids of a /tokenize answer as their JSON text (no brackets), or None when it is not a well-formed answer
    with at least one id. Read as bytes, never as a list: a 1M-token prompt's ids are spliced, not converted."""
    found = _TOKENS.search(answer, 0, 4096)
    if found is None:
        return None
    start = found.end()
    end = answer.find(b"]", start)
    ids = answer[start:end].strip() if end > start else b""
    if not ids or ids.translate(None, _NOT_IDS) or b",," in ids or ids.startswith(b",") or ids.endswith(b","):
        return None
    return ids


# Stream shapes a resumed stream writes itself (gateway/migration/): its chunks, its usage, its continuation --------

def event_json(event: bytes) -> dict[str, Any] | None:
    """The JSON object of one SSE event (`data: {...}`), or None ([DONE], anything else)."""
    at = event.find(b"data:")
    try:
        obj = orjson.loads(event[at + 5:]) if at >= 0 else None
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def sse_event(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


STREAM_DONE = b"data: [DONE]\n\n"


def chat_chunk(head: Mapping[str, Any], delta: Mapping[str, Any], finish: str | None) -> dict[str, Any]:
    """A chat stream chunk of one choice: `head` is the stream's id, created, model."""
    return {"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **head}


def completion_chunk(head: Mapping[str, Any], text: str, finish: str | None) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **head}


def stream_usage(prompt: int, completion: int) -> dict[str, int]:
    """A stream's usage counts, as vLLM's usage chunk carries them."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def usage_chunk(head: Mapping[str, Any], api: str, usage: Mapping[str, Any]) -> dict[str, Any]:
    """The usage-only chunk (`choices: []`) that ends a chat or completions stream before [DONE]."""
    kind = "chat.completion.chunk" if api == "chat" else "text_completion"
    return {"object": kind, "choices": [], "usage": usage, **head}


def continuation_body(fields: Mapping[str, Any], model: str, context: list[int], max_tokens: int | None,
                      min_tokens: int | None, skip_special_tokens: bool) -> dict[str, Any]:
    """The `/v1/completions` request that continues an answer token for token: `context` is the prompt's ids then
    the ids generated so far; `fields`: the sampling fields kept as the client sent them; streamed, with its usage
    and its token ids."""
    out: dict[str, Any] = {"model": model, "prompt": context, "stream": True,
                           "stream_options": {"include_usage": True}, "return_token_ids": True, **fields}
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    if min_tokens is not None:
        out["min_tokens"] = min_tokens
    out["skip_special_tokens"] = skip_special_tokens
    return out


def splice_prompt(body: bytes, prompt_ids: bytes, generated: list[int]) -> bytes:
    """`body` (a continuation_body with an empty `prompt`) with its prompt spliced in as bytes: `prompt_ids`, the
    prompt's ids as JSON text without brackets (as /tokenize sent them: a 1M-token prompt never becomes a Python
    list), then the `generated` ids."""
    at = body.index(b'"prompt":[]') + 10
    ids = orjson.dumps(generated)[1:-1]
    joined = prompt_ids + b"," + ids if prompt_ids and ids else prompt_ids or ids
    return b"".join((body[:at], joined, body[at:]))


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill request: the client's body computing one token, not streamed, asking the replica to keep the KV
    (`kv_transfer_params.do_remote_decode`). As the toy proxy: `max_tokens` (and `max_completion_tokens` when sent)
    1 and no `stream_options`; beyond it, no `min_tokens`, which vLLM refuses above `max_tokens` (SamplingParams:
    "min_tokens must be less than or equal to max_tokens") and which the decode request keeps."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return out


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode request: the client's own body with the prefill answer's `kv_transfer_params`, as they came (the
    decode replica pulls the prompt's blocks with them)."""
    return {**body, "kv_transfer_params": kv_transfer_params}


# What vLLM 0.32 answers a new request once SIGTERM has shut its renderer's executor down (Python's own
# ThreadPoolExecutor message), with HTTP 500, while /health still answers 200 and the streams in flight go on.
SHUTDOWN_REFUSAL = "cannot schedule new futures after shutdown"
_SHUTDOWN_REFUSAL_BYTES = SHUTDOWN_REFUSAL.encode()


def refuses_new_requests(status: int, body: bytes) -> bool:
    """The replica is shutting down and refused this request before any work: a 500 whose error message is
    SHUTDOWN_REFUSAL. Any other 500 is an ordinary failure. (The byte search first: ordinary answers cost ~0.1 µs.)"""
    if status != 500 or _SHUTDOWN_REFUSAL_BYTES not in body:
        return False
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    error = obj.get("error") if isinstance(obj, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return isinstance(message, str) and SHUTDOWN_REFUSAL in message


def connection_refused(exc: BaseException | None) -> bool:
    """The replica's port refused the connection: nothing listens there (vLLM stopped listening at SIGTERM with
    `--shutdown-timeout 0`, exited, or has not started yet), so nothing of the request reached it. Follows aiohttp's
    `os_error` and the exception's causes."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ConnectionRefusedError) or (isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED):
            return True
        exc = getattr(exc, "os_error", None) or exc.__cause__
        seen += 1
    return False


def health_says_draining(status: int) -> bool:
    """/health answers 503 when vLLM's engine is dead or going (EngineDeadError): take no new requests there."""
    return status == 503
