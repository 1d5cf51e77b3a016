"""A non-streamed answer put together from the events of the stream the gateway asked for instead.

The background lane (docs/scheduling.md) pauses a request by ending its upstream stream and resumes it exactly from
the token ids already generated; a non-streamed request has no such ids until its answer is whole. So the gateway
sends a non-streamed background request upstream as a stream, relays it through the same resumable path into a
buffer, and answers the client with the object vLLM 0.32 would have sent non-streamed: the deltas joined (content,
reasoning, tool calls by index), the finish chunk's reasons, the usage chunk, and the fields a non-streamed answer
carries (as pools/sim/shapes.py writes them, checked against vLLM by the contract suite). A stream that ended with
an error event becomes that error, in OpenAI's shape. Pure: bytes in, (status, body) out.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["answer_from_events"]

_EVENT_END = b"\n\n"
_DATA = b"data: "


def answer_from_events(events: bytes, api: str) -> tuple[int, bytes]:
    """(status, JSON body) of the non-streamed answer for the SSE `events` of a chat or completions stream as the
    client would have received them (comments and `[DONE]` skipped)."""
    chunks: list[dict[str, Any]] = []
    for event in events.split(_EVENT_END):
        event = event.strip()
        if not event.startswith(_DATA):  # a comment (": paused"), an empty tail
            continue
        data = event[len(_DATA):]
        if data == b"[DONE]":
            continue
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
            return _error(chunk["error"])
        if isinstance(chunk, dict):
            chunks.append(chunk)
    if not chunks:
        return _error({"message": "the replica's stream ended without an answer; retry the request",
                       "type": "upstream_error", "param": None, "code": 502})
    return 200, orjson.dumps(_chat(chunks) if api == "chat" else _completion(chunks))


def _error(error: dict[str, Any]) -> tuple[int, bytes]:
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    body = {"message": str(error.get("message") or "the replica failed"), "type": error.get("type") or "upstream_error",
            "param": error.get("param"), "code": code}
    return status, orjson.dumps({"error": body})


def _head(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], Any, Any]:
    """The answer's id, created, model; its system_fingerprint; its usage (the usage chunk's)."""
    first = chunks[0]
    head = {"id": first.get("id"), "created": first.get("created"), "model": first.get("model")}
    fingerprint = next((c["system_fingerprint"] for c in chunks if c.get("system_fingerprint") is not None), None)
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    return head, fingerprint, usage


def _unstreamed_usage(usage: Any, api: str) -> Any:
    """The usage chunk's figures in the non-streamed answer's shape: vLLM dumps the chunk without its null fields
    and writes them out unstreamed (a resumed stream's usage, counted by the gateway, has no details to fill)."""
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens_details"), dict):
        return usage
    details = dict(usage["prompt_tokens_details"])
    if api == "chat":
        details.setdefault("multimodal_tokens", None)
        return {**usage, "prompt_tokens_details": details}
    details.setdefault("created_cache_tokens", None)
    details.setdefault("multimodal_tokens", None)
    return {**usage, "prompt_tokens_details": details, "completion_tokens_details": usage.get(
        "completion_tokens_details")}


def _finish(choices: list[dict[str, Any]]) -> tuple[Any, Any]:
    for choice in reversed(choices):
        if choice.get("finish_reason") is not None:
            return choice["finish_reason"], choice.get("stop_reason")
    return None, None


def _choices(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for chunk in chunks for c in chunk.get("choices") or () if isinstance(c, dict)]


def _chat(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    head, fingerprint, usage = _head(chunks)
    choices = _choices(chunks)
    role, content, reasoning = "assistant", [], []
    calls: dict[int, dict[str, Any]] = {}
    for choice in choices:
        delta = choice.get("delta") or {}
        role = delta.get("role") or role
        if delta.get("content"):
            content.append(delta["content"])
        if delta.get("reasoning"):
            reasoning.append(delta["reasoning"])
        for tc in delta.get("tool_calls") or ():
            call = calls.setdefault(tc.get("index", 0), {"id": None, "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
            call["id"] = tc.get("id") or call["id"]
            call["type"] = tc.get("type") or call["type"]
            function = tc.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""
    message: dict[str, Any] = {"role": role, "content": "".join(content) or None, "refusal": None,
                               "annotations": None, "audio": None, "function_call": None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    message["reasoning"] = "".join(reasoning) or None
    finish, stop = _finish(choices)
    return {"id": head["id"], "object": "chat.completion", "created": head["created"], "model": head["model"],
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                         "stop_reason": stop, "token_ids": None, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": fingerprint, "usage": _unstreamed_usage(usage, "chat"),
            "prompt_logprobs": None,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "metrics": None}


def _completion(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    head, fingerprint, usage = _head(chunks)
    choices = _choices(chunks)
    finish, stop = _finish(choices)
    return {"id": head["id"], "object": "text_completion", "created": head["created"], "model": head["model"],
            "choices": [{"index": 0, "text": "".join(c.get("text") or "" for c in choices), "logprobs": None,
                         "finish_reason": finish, "stop_reason": stop, "token_ids": None, "prompt_logprobs": None,
                         "prompt_token_ids": None, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": fingerprint, "usage": _unstreamed_usage(usage, "completions"),
            "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None}
