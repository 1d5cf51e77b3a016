"""Response bodies and SSE events of the four generate APIs, chunk for chunk as vLLM 0.32 sends them.

Each shape turns a `Generation` (the request's plans plus the engine's progress) into bytes: `body()` for a
non-streaming answer once the engine is done, `events()` for a stream that follows the engine token by token.
Chat/completions end with `data: [DONE]`; Responses and Messages use `event: <type>` framing without it.
Chat and completions serve `n` choices: like vLLM's parallel sampling, each choice is its own engine request
(sharing one wake-up event), and their chunks interleave as the engine produces tokens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

from pools.sim.behaviour import CONTENT_WORDS, REASONING_WORDS, OutputPlan
from pools.sim.engine import SimRequest

DONE = b"data: [DONE]\n\n"
GENERATION_ERROR_MESSAGE = "Internal server error"  # vLLM's GenerationError, for finish_reason "error"
# create_streaming_error_response: json.dumps of the ErrorResponse (Python's default separators)
STREAM_ERROR = b"data: " + json.dumps({"error": {"message": GENERATION_ERROR_MESSAGE, "type": "InternalServerError",
                                                 "param": None, "code": 500}}).encode() + b"\n\n"


@dataclass
class Choice:
    """One of the request's `n` samples: its own engine request and answer plan."""

    index: int
    sim: SimRequest
    plan: OutputPlan
    offset: int = 0  # plan tokens already in the prompt (a completions request continuing a greedy answer)


@dataclass
class Generation:
    """One accepted generate request: what was asked, what will be said, and the engine's handles on it."""

    response_id: str
    created: int
    model: str
    choices: list[Choice]
    system_fingerprint: str
    stream: bool = False
    include_reasoning: bool = True
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None  # chat: top_logprobs when `logprobs` is on; completions: `logprobs`; None = off
    role: str = "assistant"  # chat: the answer's role (the last message's when add_generation_prompt is off)
    cache_block_size: int = 0  # block size when prefix caching is on (created_cache_tokens), else 0
    multimodal_tokens: dict[str, int] | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # request fields some APIs repeat in their answer
    tool_parsing: str | None = None  # request_type of vllm:tool_call_parser_invocations when tools were offered
    echo_prompt: str | None = None  # completions with `echo`: the prompt text that precedes each choice's text
    return_token_ids: bool = False  # vLLM's return_token_ids: prompt ids first, then each chunk's own ids
    prompt_ids: list[int] | None = None  # the prompt's token ids (set when return_token_ids)

    @property
    def sim(self) -> SimRequest:
        return self.choices[0].sim

    @property
    def plan(self) -> OutputPlan:
        return self.choices[0].plan

    @property
    def aborted(self) -> bool:
        return any(c.sim.finish_reason == "abort" for c in self.choices)

    @property
    def client_gone(self) -> bool:
        """Aborted because the client went away (nothing more is sent)."""
        return any(c.sim.finish_reason == "abort" and not c.sim.server_abort for c in self.choices)

    @property
    def server_aborted(self) -> bool:
        """Aborted by the replica's shutdown: chat and completions streams still end with finish_reason "abort"."""
        return any(c.sim.finish_reason == "abort" and c.sim.server_abort for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.sim.finished for c in self.choices)

    @property
    def failed(self) -> bool:
        """A choice finished with "error" (a failed KV load under kv_load_failure_policy "fail")."""
        return any(c.sim.finish_reason == "error" for c in self.choices)

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """What the connector returned as the request finished (the prefill side's handle for the decode side)."""
        return next((c.sim.kv_transfer_out for c in self.choices if c.sim.kv_transfer_out is not None), None)

    def reasoning_tokens(self, upto: int, choice: Choice | None = None) -> int:
        return min(upto, (choice or self.choices[0]).plan.reasoning_tokens)

    def finish_reason(self, choice: Choice | None = None) -> str:
        return (choice or self.choices[0]).plan.finish_reason

    def completion_tokens(self) -> int:
        return sum(c.sim.num_output for c in self.choices)

    def total_reasoning_tokens(self) -> int:
        return sum(min(c.sim.num_output, c.plan.reasoning_tokens) for c in self.choices)

    def created_cache_tokens(self) -> int:
        """vLLM's num_cache_creation_tokens: the prompt's full blocks held in the cache once prefill is done, less
        the blocks that were hits (`PrefillStats.finalize`)."""
        sim, size = self.sim, self.cache_block_size
        if size <= 0:
            return 0
        return max(0, (sim.prompt_tokens // size) * size - sim.cached_tokens)


async def progress(sim: SimRequest) -> AsyncIterator[int]:
    """Yield the count of output tokens each time it grows; stop when the request is finished."""
    seen = 0
    while True:
        if sim.num_output > seen:
            seen = sim.num_output
            yield seen
        if sim.finished:
            return
        sim.wake.clear()
        await sim.wake.wait()


async def progress_all(gen: Generation) -> AsyncIterator[list[int]]:
    """Every choice's output-token count, each time one grows; stop when all are finished. The choices share one
    wake-up event (see app.py), so any choice's progress wakes the stream."""
    seen = [0] * len(gen.choices)
    wake = gen.choices[0].sim.wake
    while True:
        counts = [c.sim.num_output for c in gen.choices]
        if counts != seen:
            seen = counts
            yield counts
        if gen.finished:
            return
        wake.clear()
        await wake.wait()


async def wait_finished(gen: Generation) -> None:
    wake = gen.choices[0].sim.wake
    while not gen.finished:
        wake.clear()
        await wake.wait()


def _before_abort(gen: Generation, sent: int, upto: int) -> int:
    """How far a stream's token chunks go: a shutdown's abort chunk carries the last token itself (vLLM's abort
    output is the step's delta), so it is left out of the token chunks."""
    return upto - 1 if gen.server_aborted and upto > sent else upto


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def chat_usage(gen: Generation, *, streaming: bool) -> dict[str, Any]:
    """Chat's usage: prompt details with cached and created-cache tokens, reasoning tokens summed over choices.
    The streamed usage chunk is dumped with exclude_none, so `multimodal_tokens` is absent there unless set."""
    sim = gen.sim
    completion = gen.completion_tokens()
    details: dict[str, Any] = {"cached_tokens": sim.usage_cached_tokens,
                               "created_cache_tokens": gen.created_cache_tokens()}
    if not streaming or gen.multimodal_tokens:
        details["multimodal_tokens"] = gen.multimodal_tokens
    return {"prompt_tokens": sim.prompt_tokens, "total_tokens": sim.prompt_tokens + completion,
            "completion_tokens": completion, "prompt_tokens_details": details,
            "completion_tokens_details": {"reasoning_tokens": gen.total_reasoning_tokens()}}


def completion_usage(gen: Generation, *, streaming: bool) -> dict[str, Any]:
    """Completions' usage: only `cached_tokens` is filled in; unstreamed, the other fields are null."""
    sim = gen.sim
    completion = gen.completion_tokens()
    usage: dict[str, Any] = {"prompt_tokens": sim.prompt_tokens, "total_tokens": sim.prompt_tokens + completion,
                             "completion_tokens": completion}
    if streaming:
        usage["prompt_tokens_details"] = {"cached_tokens": sim.usage_cached_tokens}
    else:
        usage["prompt_tokens_details"] = {"cached_tokens": sim.usage_cached_tokens, "created_cache_tokens": None,
                                          "multimodal_tokens": None}
        usage["completion_tokens_details"] = None
    return usage


# ---------------------------------------------------------------------------------------------------------------
# Logprobs: plausible, deterministic numbers (the simulator has no model); the shapes are vLLM's.

_ALTERNATIVES = tuple(dict.fromkeys(CONTENT_WORDS + REASONING_WORDS))


def _token_text(plan: OutputPlan, index: int) -> str:
    return plan.piece(index)[1]


def _sampled_logprob(choice: Choice, index: int) -> float:
    h = xxhash.xxh64_intdigest(f"{choice.plan.word_offset}:{choice.index}:{index}".encode())
    return -round(0.01 + (h % 4000) / 1000, 6)


def _top(choice: Choice, index: int, k: int) -> list[tuple[str, float]]:
    """The sampled token first, then k-1 others ranked below it."""
    text = _token_text(choice.plan, index)
    lp = _sampled_logprob(choice, index)
    out = [(text, lp)]
    h = xxhash.xxh64_intdigest(f"alt:{choice.plan.word_offset}:{choice.index}:{index}".encode())
    j = 0
    while len(out) < k and j < len(_ALTERNATIVES):
        alt = _ALTERNATIVES[(h + j * 7) % len(_ALTERNATIVES)]
        j += 1
        if all(alt != t for t, _ in out):
            out.append((alt, round(lp - 0.25 * len(out) - (h >> (j % 32) & 0xFF) / 1000, 6)))
    return out


def chat_logprobs(choice: Choice, start: int, end: int, k: int) -> dict[str, Any]:
    content = []
    for i in range(start, end):
        text = _token_text(choice.plan, i)
        content.append({"token": text, "logprob": _sampled_logprob(choice, i), "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                         for t, lp in _top(choice, i, k)] if k > 0 else []})
    return {"content": content}


def completion_logprobs(choice: Choice, start: int, end: int, k: int, offset: int) -> dict[str, Any]:
    tokens, logprobs, offsets, tops = [], [], [], []
    for i in range(start, end):
        text = _token_text(choice.plan, i)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        logprobs.append(_sampled_logprob(choice, i))
        tops.append(dict(_top(choice, i, k + 1)))
    return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens, "top_logprobs": tops}


# ---------------------------------------------------------------------------------------------------------------
# /v1/chat/completions


class ChatShape:
    @staticmethod
    def delta(gen: Generation, index: int, choice: Choice | None = None) -> dict[str, Any] | None:
        """The delta that output token `index` produces, or None when the parsers hold it back."""
        plan = (choice or gen.choices[0]).plan
        kind, text = plan.piece(index)
        if kind == "content":  # with reasoning hidden, the parser sets reasoning=None explicitly on every delta
            return {"content": text} if gen.include_reasoning else {"content": text, "reasoning": None}
        if kind == "reasoning":
            return {"content": None, "reasoning": text} if gen.include_reasoning else None
        call = plan.tool_call
        assert call is not None
        j = index - plan.reasoning_tokens - plan.content_tokens
        header = j == call.header_at
        args = j == call.tokens - 1
        if not (header or args):
            return None
        tc: dict[str, Any] = {"index": 0, "function": {}}
        if header:
            tc = {"id": call.call_id, "type": "function", "index": 0, "function": {"name": call.name}}
        if args:
            tc["function"]["arguments"] = call.arguments
        return {"tool_calls": [tc]} if gen.include_reasoning else {"reasoning": None, "tool_calls": [tc]}

    @staticmethod
    def _logprobs_k(gen: Generation) -> int | None:
        # With reasoning hidden, vLLM suppresses logprobs too (they would leak the reasoning tokens).
        return gen.logprobs if gen.include_reasoning else None

    @staticmethod
    def _running_usage(gen: Generation, choice: Choice, completion: int) -> dict[str, Any]:
        prompt = choice.sim.prompt_tokens
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
                "completion_tokens_details": {"reasoning_tokens": min(completion, choice.plan.reasoning_tokens)}}

    @staticmethod
    async def events(gen: Generation) -> AsyncIterator[bytes]:
        head = {"id": gen.response_id, "object": "chat.completion.chunk", "created": gen.created, "model": gen.model}
        k = ChatShape._logprobs_k(gen)
        # With reasoning hidden vLLM also hides token ids (they would leak the reasoning); a held-back token still
        # gets its own chunk (empty delta) when ids are returned, so every id reaches the client.
        with_ids = gen.return_token_ids and gen.include_reasoning
        sent = [0] * len(gen.choices)
        started = False
        async for counts in progress_all(gen):
            if gen.client_gone:
                return
            if not started:
                started = True
                for chunk in ChatShape._role_chunks(gen, head):
                    yield chunk
            for choice, upto in zip(gen.choices, counts, strict=True):
                total = choice.plan.total_tokens
                upto = _before_abort(gen, sent[choice.index], upto)
                for i in range(sent[choice.index], upto):
                    last = i == total - 1
                    delta = ChatShape.delta(gen, i, choice)
                    if delta is None and not last and k is None and not with_ids:
                        continue
                    item: dict[str, Any] = {"index": choice.index, "delta": delta or {},
                                            "logprobs": chat_logprobs(choice, i, i + 1, k) if k is not None else None,
                                            "finish_reason": gen.finish_reason(choice) if last else None}
                    if last:
                        item["stop_reason"] = None
                    item["token_ids"] = [choice.plan.token_id(i)] if with_ids else None
                    chunk: dict[str, Any] = {**head, "choices": [item]}
                    if last and not gen.include_usage:
                        chunk["system_fingerprint"] = gen.system_fingerprint
                    if gen.continuous_usage:
                        chunk["usage"] = ChatShape._running_usage(gen, choice, i + 1)
                    yield _sse(chunk)
                sent[choice.index] = upto
        if gen.client_gone:
            return
        if gen.server_aborted:
            if not started:  # the first engine output is the abort: the role chunk still goes out
                for chunk in ChatShape._role_chunks(gen, head):
                    yield chunk
            for chunk in ChatShape._abort_chunks(gen, head, sent, with_ids):
                yield chunk
        elif gen.failed:  # the engine's first output is the error: role chunks, then the error event
            if not started:
                for chunk in ChatShape._role_chunks(gen, head):
                    yield chunk
            yield STREAM_ERROR
            yield DONE
            return
        if gen.include_usage:
            yield _sse({**head, "choices": [], "usage": chat_usage(gen, streaming=True),
                        "system_fingerprint": gen.system_fingerprint})
        yield DONE

    @staticmethod
    def _abort_chunks(gen: Generation, head: dict[str, Any], sent: list[int], with_ids: bool) -> list[bytes]:
        """A shutdown's abort chunk per choice, carrying the last delta (the token the stream has not sent); vLLM
        skips an empty output, so an answer with no token has no end."""
        chunks = []
        for choice in gen.choices:
            if choice.sim.num_output:
                last = range(sent[choice.index], choice.sim.num_output)
                delta = {} if not last else ChatShape.delta(gen, last[0], choice) or {}
                chunks.append(_sse({**head, "choices": [{
                    "index": choice.index, "delta": delta, "logprobs": None, "finish_reason": "abort",
                    "stop_reason": None, "token_ids": [choice.plan.token_id(i) for i in last] if with_ids else None}]}))
        return chunks

    @staticmethod
    def _role_chunks(gen: Generation, head: dict[str, Any]) -> list[bytes]:
        chunks = []
        for choice in gen.choices:
            role: dict[str, Any] = {**head, "choices": [{"index": choice.index, "delta": {
                "role": gen.role, "content": ""}, "logprobs": None, "finish_reason": None}],
                "prompt_token_ids": gen.prompt_ids if gen.return_token_ids else None, "prompt_text": None}
            if gen.continuous_usage:
                role["usage"] = ChatShape._running_usage(gen, choice, 0)
            chunks.append(_sse(role))
        return chunks

    @staticmethod
    def _choice(gen: Generation, choice: Choice) -> dict[str, Any]:
        plan, out = choice.plan, choice.sim.num_output  # fewer than planned when a shutdown aborted it
        reasoning = (plan.text("reasoning", out) or None) if plan.reasoning_tokens and gen.include_reasoning else None
        content = plan.text("content", out) if plan.content_tokens and out > plan.reasoning_tokens else None
        message: dict[str, Any] = {"role": gen.role, "content": content, "refusal": None, "annotations": None,
                                   "audio": None, "function_call": None}
        if plan.tool_call is not None and out >= plan.total_tokens:
            call = plan.tool_call
            message["tool_calls"] = [{"id": call.call_id, "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}]
        message["reasoning"] = reasoning
        k = ChatShape._logprobs_k(gen)
        logprobs = chat_logprobs(choice, 0, choice.sim.num_output, k) if k is not None else None
        ids = ([plan.token_id(i) for i in range(choice.sim.num_output)]
               if gen.return_token_ids and gen.include_reasoning else None)
        finish = "abort" if choice.sim.finish_reason == "abort" else gen.finish_reason(choice)
        return {"index": choice.index, "message": message, "logprobs": logprobs,
                "finish_reason": finish, "stop_reason": None, "token_ids": ids,
                "routed_experts": None}

    @staticmethod
    def body(gen: Generation) -> bytes:
        return orjson.dumps({
            "id": gen.response_id, "object": "chat.completion", "created": gen.created, "model": gen.model,
            "choices": [ChatShape._choice(gen, c) for c in gen.choices],
            "service_tier": None, "system_fingerprint": gen.system_fingerprint,
            "usage": chat_usage(gen, streaming=False), "prompt_logprobs": None,
            "prompt_token_ids": gen.prompt_ids if gen.return_token_ids else None,
            "prompt_text": None, "kv_transfer_params": gen.kv_transfer_params, "ec_transfer_params": None,
            "metrics": None})


# ---------------------------------------------------------------------------------------------------------------
# /v1/completions


class CompletionShape:
    @staticmethod
    async def events(gen: Generation) -> AsyncIterator[bytes]:
        head = {"id": gen.response_id, "object": "text_completion", "created": gen.created, "model": gen.model}
        k = gen.logprobs
        sent = [0] * len(gen.choices)
        offsets = [0] * len(gen.choices)
        async for counts in progress_all(gen):
            if gen.client_gone:
                return
            for choice, upto in zip(gen.choices, counts, strict=True):
                total, off = choice.sim.output_tokens, choice.offset
                upto = _before_abort(gen, sent[choice.index], upto)
                for i in range(sent[choice.index], upto):
                    last = i == total - 1
                    text = choice.plan.raw_piece(off + i)
                    logprobs = None
                    if k is not None:
                        logprobs = completion_logprobs(choice, i, i + 1, k, offsets[choice.index])
                        offsets[choice.index] += len(text)
                    if i == 0 and gen.echo_prompt is not None:
                        text = gen.echo_prompt + text  # the first chunk echoes the prompt
                    ids = gen.return_token_ids
                    chunk: dict[str, Any] = {**head, "choices": [{
                        "index": choice.index, "text": text, "logprobs": logprobs,
                        "finish_reason": choice.plan.engine_finish if last else None, "stop_reason": None,
                        "prompt_token_ids": gen.prompt_ids if ids and i == 0 else None,
                        "token_ids": [choice.plan.token_id(off + i)] if ids else None}]}
                    if last and not gen.include_usage:
                        chunk["system_fingerprint"] = gen.system_fingerprint
                    if gen.continuous_usage:
                        prompt = choice.sim.prompt_tokens
                        chunk["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt + i + 1,
                                          "completion_tokens": i + 1}
                    yield _sse(chunk)
                sent[choice.index] = upto
        if gen.client_gone:
            return
        if gen.server_aborted:
            for chunk in CompletionShape._abort_chunks(gen, head, sent):
                yield chunk
        elif gen.failed:
            yield STREAM_ERROR
            yield DONE
            return
        if gen.include_usage:
            yield _sse({**head, "choices": [], "usage": completion_usage(gen, streaming=True),
                        "system_fingerprint": gen.system_fingerprint})
        yield DONE

    @staticmethod
    def _abort_chunks(gen: Generation, head: dict[str, Any], sent: list[int]) -> list[bytes]:
        """A shutdown's abort chunk per choice that has output, carrying the last delta (text and ids)."""
        chunks, ids = [], gen.return_token_ids
        for choice in gen.choices:
            if choice.sim.num_output:
                last = range(sent[choice.index], choice.sim.num_output)
                chunks.append(_sse({**head, "choices": [{
                    "index": choice.index, "text": "".join(choice.plan.raw_piece(choice.offset + i) for i in last),
                    "logprobs": None, "finish_reason": "abort", "stop_reason": None,
                    "prompt_token_ids": gen.prompt_ids if ids and not sent[choice.index] else None,
                    "token_ids": [choice.plan.token_id(choice.offset + i) for i in last] if ids else None}]}))
        return chunks

    @staticmethod
    def body(gen: Generation) -> bytes:
        k = gen.logprobs
        echo = gen.echo_prompt or ""
        ids = gen.return_token_ids
        choices = [{"index": c.index,
                    "text": echo + "".join(c.plan.raw_piece(c.offset + i) for i in range(c.sim.num_output)),
                    "logprobs": completion_logprobs(c, 0, c.sim.num_output, k, 0) if k is not None else None,
                    "finish_reason": "abort" if c.sim.finish_reason == "abort" else c.plan.engine_finish,
                    "stop_reason": None,
                    "token_ids": [c.plan.token_id(c.offset + i) for i in range(c.sim.num_output)] if ids else None,
                    "prompt_logprobs": None, "prompt_token_ids": gen.prompt_ids if ids else None,
                    "routed_experts": None} for c in gen.choices]
        return orjson.dumps({
            "id": gen.response_id, "object": "text_completion", "created": gen.created, "model": gen.model,
            "choices": choices, "service_tier": None, "system_fingerprint": gen.system_fingerprint,
            "usage": completion_usage(gen, streaming=False), "kv_transfer_params": gen.kv_transfer_params,
            "ec_transfer_params": None, "metrics": None})


# ---------------------------------------------------------------------------------------------------------------
# Segments: Responses and Messages stream whole output items (reasoning, text, tool call) rather than deltas.


def _segments(plan: OutputPlan) -> list[tuple[str, int, int]]:
    """(kind, first token, end token) of each output item, in order."""
    out = []
    start = 0
    for kind, n in (("reasoning", plan.reasoning_tokens), ("content", plan.content_tokens),
                    ("tool", plan.tool_call.tokens if plan.tool_call else 0)):
        if n:
            out.append((kind, start, start + n))
            start += n
    return out


# ---------------------------------------------------------------------------------------------------------------
# /v1/responses


class ResponsesShape:
    @staticmethod
    def _item_id(gen: Generation, kind: str) -> str:
        if kind == "reasoning":
            return f"rs_{gen.response_id[5:]}"
        if kind == "content":
            return f"msg_{gen.response_id[5:]}"
        call_id = gen.plan.tool_call.call_id if gen.plan.tool_call else ""
        return f"fc_{call_id[-24:]}"

    @staticmethod
    def _opened_item(gen: Generation, kind: str, item_id: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"id": item_id, "type": "reasoning", "summary": [], "content": [], "encrypted_content": None,
                    "status": "in_progress"}
        if kind == "content":
            return {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        call = gen.plan.tool_call
        assert call is not None
        return {"id": item_id, "type": "function_call", "call_id": f"call_{call.call_id[-24:]}", "name": call.name,
                "arguments": "", "status": "in_progress"}

    @staticmethod
    def _items(gen: Generation, upto: int) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        for kind, start, end in _segments(gen.plan):
            if start >= upto:
                break
            done = upto >= end
            status = "completed" if done else "incomplete"
            if kind == "reasoning":
                items.append({"id": ResponsesShape._item_id(gen, kind), "type": "reasoning", "summary": [],
                              "content": [{"type": "reasoning_text", "text": gen.plan.text("reasoning", upto)}],
                              "encrypted_content": None, "status": status})
            elif kind == "content":
                items.append({"id": ResponsesShape._item_id(gen, kind), "type": "message", "role": "assistant",
                              "status": status, "content": [{"type": "output_text", "text":
                                                             gen.plan.text("content", upto), "annotations": [],
                                                             "logprobs": None}]})
            elif done and gen.plan.tool_call is not None:
                call = gen.plan.tool_call
                items.append({"id": ResponsesShape._item_id(gen, kind), "type": "function_call",
                              "call_id": f"call_{call.call_id[-24:]}", "name": call.name,
                              "arguments": call.arguments, "status": "completed"})
        return items

    @staticmethod
    def response(gen: Generation, status: str, upto: int) -> dict[str, Any]:
        sim = gen.sim
        incomplete = status == "incomplete"
        return {
            "id": gen.response_id, "object": "response", "created_at": gen.created, "model": gen.model,
            "status": status, "output": ResponsesShape._items(gen, upto) if status != "in_progress" else [],
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": gen.echo.get("instructions"), "max_output_tokens": gen.echo.get("max_output_tokens"),
            "metadata": None, "parallel_tool_calls": True, "previous_response_id": None, "reasoning": None,
            "service_tier": "auto", "store": False, "temperature": gen.echo.get("temperature"),
            "text": gen.echo.get("text") or {"format": {"type": "text"}},
            "tool_choice": gen.echo.get("tool_choice", "auto"),
            "tools": gen.echo.get("tools") or [], "top_p": gen.echo.get("top_p"), "truncation": "disabled",
            "user": None, "background": False,
            "usage": None if status == "in_progress" else {
                "input_tokens": sim.prompt_tokens, "output_tokens": sim.num_output,
                "total_tokens": sim.prompt_tokens + sim.num_output,
                "input_tokens_details": {"cached_tokens": sim.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": gen.reasoning_tokens(sim.num_output)}},
        }

    @staticmethod
    def _final_status(gen: Generation) -> str:
        return "incomplete" if gen.finish_reason() == "length" else "completed"

    @staticmethod
    def body(gen: Generation) -> bytes:
        return orjson.dumps(ResponsesShape.response(gen, ResponsesShape._final_status(gen), gen.sim.num_output))

    @staticmethod
    async def events(gen: Generation) -> AsyncIterator[bytes]:
        seq = 0

        def ev(kind: str, **payload: Any) -> bytes:
            nonlocal seq
            out = _event(kind, {"type": kind, "sequence_number": seq, **payload})
            seq += 1
            return out

        yield ev("response.created", response=ResponsesShape.response(gen, "in_progress", 0))
        yield ev("response.in_progress", response=ResponsesShape.response(gen, "in_progress", 0))
        segments = _segments(gen.plan)
        sent = 0
        opened = -1
        async for upto in progress(gen.sim):
            if gen.aborted:
                return
            for out_index, (kind, start, end) in enumerate(segments):
                if start >= upto or end <= sent:
                    continue
                item_id = ResponsesShape._item_id(gen, kind)
                if out_index > opened:
                    opened = out_index
                    yield ev("response.output_item.added", output_index=out_index,
                             item=ResponsesShape._opened_item(gen, kind, item_id))
                    if kind == "content":
                        yield ev("response.content_part.added", item_id=item_id, output_index=out_index,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []})
                    elif kind == "reasoning":
                        yield ev("response.content_part.added", item_id=item_id, output_index=out_index,
                                 content_index=0, part={"type": "reasoning_text", "text": ""})
                for i in range(max(sent, start), min(upto, end)):
                    text = gen.plan.piece(i)[1]
                    if kind == "content":
                        yield ev("response.output_text.delta", item_id=item_id, output_index=out_index,
                                 content_index=0, delta=text, logprobs=[])
                    elif kind == "reasoning":
                        yield ev("response.reasoning_text.delta", item_id=item_id, output_index=out_index,
                                 content_index=0, delta=text)
                if upto >= end:
                    item = ResponsesShape._items(gen, end)[out_index]
                    if kind == "content":
                        full = item["content"][0]["text"]
                        yield ev("response.output_text.done", item_id=item_id, output_index=out_index,
                                 content_index=0, text=full, logprobs=[])
                        yield ev("response.content_part.done", item_id=item_id, output_index=out_index,
                                 content_index=0, part=item["content"][0])
                    elif kind == "reasoning":
                        full = item["content"][0]["text"]
                        yield ev("response.reasoning_text.done", item_id=item_id, output_index=out_index,
                                 content_index=0, text=full)
                        yield ev("response.content_part.done", item_id=item_id, output_index=out_index,
                                 content_index=0, part=item["content"][0])
                    else:
                        yield ev("response.function_call_arguments.delta", item_id=item_id,
                                 output_index=out_index, delta=item["arguments"])
                        yield ev("response.function_call_arguments.done", item_id=item_id,
                                 output_index=out_index, name=item["name"], arguments=item["arguments"])
                    yield ev("response.output_item.done", output_index=out_index, item=item)
            sent = upto
        if gen.aborted:
            return
        status = ResponsesShape._final_status(gen)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield ev(kind, response=ResponsesShape.response(gen, status, gen.sim.num_output))


# ---------------------------------------------------------------------------------------------------------------
# /v1/messages (Anthropic)


class MessagesShape:
    @staticmethod
    def stop_reason(gen: Generation) -> str:
        return {"tool_calls": "tool_use", "length": "max_tokens"}.get(gen.finish_reason(), "end_turn")

    @staticmethod
    def _blocks(gen: Generation) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        for kind, _, _ in _segments(gen.plan):
            if kind == "reasoning":
                blocks.append({"type": "thinking", "thinking": gen.plan.text("reasoning"), "signature": ""})
            elif kind == "content":
                blocks.append({"type": "text", "text": gen.plan.text("content")})
            elif gen.plan.tool_call is not None:
                call = gen.plan.tool_call
                blocks.append({"type": "tool_use", "id": f"toolu_{call.call_id[-24:]}", "name": call.name,
                               "input": orjson.loads(call.arguments)})
        return blocks

    @staticmethod
    def _usage(gen: Generation, output_tokens: int) -> dict[str, Any]:
        """vLLM's `_build_anthropic_usage`: Anthropic's input_tokens exclude cache reads and cache writes."""
        sim = gen.sim
        read, created = sim.cached_tokens, gen.created_cache_tokens()
        return {"input_tokens": max(0, sim.prompt_tokens - read - created), "output_tokens": output_tokens,
                "cache_creation_input_tokens": created, "cache_read_input_tokens": read}

    @staticmethod
    def body(gen: Generation) -> bytes:
        # Dumped with exclude_none: no `stop_sequence: null`.
        return orjson.dumps({"id": gen.response_id, "type": "message", "role": "assistant",
                             "content": MessagesShape._blocks(gen), "model": gen.model,
                             "stop_reason": MessagesShape.stop_reason(gen),
                             "usage": MessagesShape._usage(gen, gen.sim.num_output)})

    @staticmethod
    async def events(gen: Generation) -> AsyncIterator[bytes]:
        # The first chat chunk carries only running usage (no prompt details): the whole prompt, nothing out yet.
        yield _event("message_start", {"type": "message_start", "message": {
            "id": gen.response_id, "type": "message", "role": "assistant", "content": [], "model": gen.model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": gen.sim.prompt_tokens, "output_tokens": 0}}})
        segments = _segments(gen.plan)
        blocks = MessagesShape._blocks(gen)
        sent = 0
        opened = -1
        async for upto in progress(gen.sim):
            if gen.aborted:
                return
            for index, (kind, start, end) in enumerate(segments):
                if start >= upto or end <= sent:
                    continue
                if index > opened:
                    opened = index
                    start_block = dict(blocks[index])
                    if kind == "reasoning":
                        start_block["thinking"] = ""
                    elif kind == "content":
                        start_block["text"] = ""
                    else:
                        start_block["input"] = {}
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": start_block})
                for i in range(max(sent, start), min(upto, end)):
                    text = gen.plan.piece(i)[1]
                    if kind == "reasoning":
                        delta = {"type": "thinking_delta", "thinking": text}
                    elif kind == "content":
                        delta = {"type": "text_delta", "text": text}
                    else:
                        continue
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                         "delta": delta})
                if upto >= end:
                    if kind == "tool" and gen.plan.tool_call is not None:
                        yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                            "type": "input_json_delta", "partial_json": gen.plan.tool_call.arguments}})
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            sent = upto
        if gen.aborted:
            return
        yield _event("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": MessagesShape.stop_reason(gen), "stop_sequence": None},
            "usage": MessagesShape._usage(gen, gen.sim.num_output)})
        yield _event("message_stop", {"type": "message_stop"})


def new_id() -> str:
    return uuid.uuid4().hex
