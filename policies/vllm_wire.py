"""vLLM's request and response shapes that the gateway writes or reads itself, in one place.

The gateway relays bodies byte for byte; it only builds or reads a few of vLLM's shapes on its own: the usage of an
answer (token counts, in each API's shape), the `/tokenize` body that counts a generate request's prompt exactly, and
the prefill request of disaggregated serving (NIXL's KV-transfer protocol, as vLLM's toy proxy
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
