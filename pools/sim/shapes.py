"""Response bodies and SSE events of the four generate APIs, chunk for chunk as vLLM 0.32 sends them.

Each shape turns a `Generation` (the request's plan plus the engine's progress) into bytes: `body()` for a
non-streaming answer once the engine is done, `events()` for a stream that follows the engine token by token.
Chat/completions end with `data: [DONE]`; Responses and Messages use `event: <type>` framing without it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from pools.sim.behaviour import OutputPlan
from pools.sim.engine import SimRequest

DONE = b"data: [DONE]\n\n"


@dataclass
class Generation:
    """One accepted generate request: what was asked, what will be said, and the engine's handle on it."""

    response_id: str
    created: int
    model: str
    sim: SimRequest
    plan: OutputPlan
    system_fingerprint: str
    stream: bool = False
    include_reasoning: bool = True
    include_usage: bool = False
    continuous_usage: bool = False
    echo: dict[str, Any] = field(default_factory=dict)  # request fields some APIs repeat in their answer

    @property
    def aborted(self) -> bool:
        return self.sim.finish_reason == "abort"

    def reasoning_tokens(self, upto: int) -> int:
        return min(upto, self.plan.reasoning_tokens)

    def finish_reason(self) -> str:
        return self.plan.finish_reason


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


async def wait_finished(sim: SimRequest) -> None:
    while not sim.finished:
        sim.wake.clear()
        await sim.wake.wait()


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def openai_usage(gen: Generation, *, streaming: bool) -> dict[str, Any]:
    sim = gen.sim
    details: dict[str, Any] = {"cached_tokens": sim.cached_tokens, "created_cache_tokens": 0}
    if not streaming:
        details["multimodal_tokens"] = None
    return {"prompt_tokens": sim.prompt_tokens, "total_tokens": sim.prompt_tokens + sim.num_output,
            "completion_tokens": sim.num_output, "prompt_tokens_details": details,
            "completion_tokens_details": {"reasoning_tokens": gen.reasoning_tokens(sim.num_output)}}


# ---------------------------------------------------------------------------------------------------------------
# /v1/chat/completions


class ChatShape:
    @staticmethod
    def delta(gen: Generation, index: int) -> dict[str, Any] | None:
        """The delta that output token `index` produces, or None when the parsers hold it back."""
        kind, text = gen.plan.piece(index)
        if kind == "content":
            return {"content": text}
        if kind == "reasoning":
            return {"content": None, "reasoning": text} if gen.include_reasoning else None
        call = gen.plan.tool_call
        assert call is not None
        j = index - gen.plan.reasoning_tokens - gen.plan.content_tokens
        header = j == call.header_at
        args = j == call.tokens - 1
        if not (header or args):
            return None
        tc: dict[str, Any] = {"index": 0, "function": {}}
        if header:
            tc = {"id": call.call_id, "type": "function", "index": 0, "function": {"name": call.name}}
        if args:
            tc["function"]["arguments"] = call.arguments
        return {"tool_calls": [tc]}

    @staticmethod
    async def events(gen: Generation) -> AsyncIterator[bytes]:
        head = {"id": gen.response_id, "object": "chat.completion.chunk", "created": gen.created, "model": gen.model}
        sim, total = gen.sim, gen.plan.total_tokens
        sent = 0
        async for upto in progress(sim):
            if gen.aborted:
                return
            if sent == 0:
                role: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                             "logprobs": None, "finish_reason": None}],
                                        "prompt_token_ids": None, "prompt_text": None}
                if gen.continuous_usage:
                    role["usage"] = _running_usage(sim, 0)
                yield _sse(role)
            for i in range(sent, upto):
                last = i == total - 1
                delta = ChatShape.delta(gen, i)
                if delta is None and not last:
                    continue
                choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "logprobs": None,
                                          "finish_reason": gen.finish_reason() if last else None}
                if last:
                    choice["stop_reason"] = None
                choice["token_ids"] = None
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if last and not gen.include_usage:
                    chunk["system_fingerprint"] = gen.system_fingerprint
                if gen.continuous_usage:
                    chunk["usage"] = _running_usage(sim, i + 1)
                yield _sse(chunk)
            sent = upto
        if gen.aborted:
            return
        if gen.include_usage:
            yield _sse({**head, "choices": [], "usage": openai_usage(gen, streaming=True),
                        "system_fingerprint": gen.system_fingerprint})
        yield DONE

    @staticmethod
    def body(gen: Generation) -> bytes:
        plan = gen.plan
        reasoning = plan.text("reasoning") if plan.reasoning_tokens and gen.include_reasoning else None
        content = plan.text("content") if plan.content_tokens else None
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                                   "audio": None, "function_call": None}
        if plan.tool_call is not None:
            call = plan.tool_call
            message["tool_calls"] = [{"id": call.call_id, "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}]
        message["reasoning"] = reasoning
        return orjson.dumps({
            "id": gen.response_id, "object": "chat.completion", "created": gen.created, "model": gen.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": gen.finish_reason(),
                         "stop_reason": None, "token_ids": None, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": gen.system_fingerprint,
            "usage": openai_usage(gen, streaming=False), "prompt_logprobs": None, "prompt_token_ids": None,
            "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})


def _running_usage(sim: SimRequest, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": sim.prompt_tokens, "total_tokens": sim.prompt_tokens + completion,
            "completion_tokens": completion}


# ---------------------------------------------------------------------------------------------------------------
# /v1/completions


class CompletionShape:
    @staticmethod
    async def events(gen: Generation) -> AsyncIterator[bytes]:
        head = {"id": gen.response_id, "object": "text_completion", "created": gen.created, "model": gen.model}
        sim, total = gen.sim, gen.plan.total_tokens
        sent = 0
        async for upto in progress(sim):
            if gen.aborted:
                return
            for i in range(sent, upto):
                last = i == total - 1
                chunk: dict[str, Any] = {**head, "choices": [{
                    "index": 0, "text": gen.plan.piece(i)[1], "logprobs": None,
                    "finish_reason": gen.finish_reason() if last else None, "stop_reason": None,
                    "prompt_token_ids": None, "token_ids": None}]}
                if gen.continuous_usage:
                    chunk["usage"] = _running_usage(sim, i + 1)
                yield _sse(chunk)
            sent = upto
        if gen.aborted:
            return
        if gen.include_usage:
            yield _sse({**head, "choices": [], "usage": openai_usage(gen, streaming=True)})
        yield DONE

    @staticmethod
    def body(gen: Generation) -> bytes:
        return orjson.dumps({
            "id": gen.response_id, "object": "text_completion", "created": gen.created, "model": gen.model,
            "choices": [{"index": 0, "text": gen.plan.text("content"), "logprobs": None,
                         "finish_reason": gen.finish_reason(), "stop_reason": None, "prompt_logprobs": None,
                         "prompt_token_ids": None, "token_ids": None, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": gen.system_fingerprint,
            "usage": openai_usage(gen, streaming=False), "kv_transfer_params": None})


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
            "text": {"format": {"type": "text"}}, "tool_choice": gen.echo.get("tool_choice", "auto"),
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
        sim = gen.sim
        return {"input_tokens": sim.prompt_tokens, "output_tokens": output_tokens,
                "cache_read_input_tokens": sim.cached_tokens, "cache_creation_input_tokens": 0}

    @staticmethod
    def body(gen: Generation) -> bytes:
        return orjson.dumps({"id": gen.response_id, "type": "message", "role": "assistant", "model": gen.model,
                             "content": MessagesShape._blocks(gen), "stop_reason": MessagesShape.stop_reason(gen),
                             "stop_sequence": None, "usage": MessagesShape._usage(gen, gen.sim.num_output)})

    @staticmethod
    async def events(gen: Generation) -> AsyncIterator[bytes]:
        yield _event("message_start", {"type": "message_start", "message": {
            "id": gen.response_id, "type": "message", "role": "assistant", "model": gen.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": MessagesShape._usage(gen, 0)}})
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
