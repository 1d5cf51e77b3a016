"""Stream migration's decisions: which streams can be resumed, the body that resumes one, where a chat stream is cut.

A stream is resumed token for token on another replica through `/v1/completions` with a token-id prompt: the
original prompt's ids, then the ids generated so far, `max_tokens` less their count and the same sampling
parameters (docs/stream-migration.md). Only state that lives in the token ids can be carried across, hence
`refusal`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson

from policies.m3_stream import ParserState, initial_state
from policies.vllm_wire import continuation_body, splice_prompt

# Sampling and output fields a continuation keeps as the client sent them (everything else is rebuilt).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words", "allowed_token_ids",
    "include_stop_str_in_output", "spaces_between_special_tokens", "priority", "user",
)
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
               "structured_outputs", "guided_whitespace_pattern")


def refusal(body: dict[str, Any], api: str) -> str | None:
    """Why a stream of `body` cannot be resumed elsewhere (None: it can). Structured output keeps grammar state
    the ids do not carry; several choices, echo and prompt logprobs have no token-id continuation; with
    include_reasoning false vLLM sends no ids; chat logprobs would come back in the completions shape."""
    if api not in ("chat", "completions"):
        return "api"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n"
    fmt = body.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object", "structural_tag")) or any(
            body.get(key) is not None for key in _STRUCTURED):
        return "structured_output"
    if body.get("echo") or body.get("prompt_logprobs") is not None:
        return "echo"
    if body.get("include_reasoning") is False:
        return "include_reasoning"
    if body.get("return_token_ids") or body.get("logprobs") not in (None, False):
        return "token_output"
    if api == "completions":
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                            and all(isinstance(t, int) for t in prompt))):
            return "prompt"
    return None


def output_budget(body: dict[str, Any], api: str) -> int | None:
    """The client's max_tokens (chat: max_completion_tokens first), or None when it left it to the server."""
    value = body.get("max_completion_tokens") if api == "chat" else None
    value = body.get("max_tokens") if value is None else value
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def resume_body(body: dict[str, Any], api: str, model: str, context: list[int], done: int) -> dict[str, Any]:
    """The `/v1/completions` body that continues `body`'s answer after `done` generated tokens; `context` is the
    prompt's ids followed by those tokens. Chat's M3 parser keeps special tokens (the markers must come back as
    text); completions keep the client's choice."""
    budget = output_budget(body, api)
    min_tokens = body.get("min_tokens")
    return continuation_body(
        {key: body[key] for key in SAMPLING_FIELDS if key in body}, model, context,
        budget - done if budget is not None else None,
        max(0, min_tokens - done) if isinstance(min_tokens, int) and min_tokens > 0 else None,
        body.get("skip_special_tokens", True) if api == "completions" else False)


def resume_payload(body: dict[str, Any], api: str, model: str, prompt_ids: bytes, generated: list[int]) -> bytes:
    """`resume_body` as bytes, its prompt spliced from `prompt_ids` (the prompt's ids as JSON text, no brackets)
    followed by the `generated` ids."""
    return splice_prompt(orjson.dumps(resume_body(body, api, model, [], len(generated))), prompt_ids, generated)


def nothing_left(body: dict[str, Any], api: str, done: int) -> bool:
    """Every token the client allowed is out: the answer ends here (`length`), there is nothing to resume."""
    budget = output_budget(body, api)
    return budget is not None and done >= budget


def chat_finish_reason(body: dict[str, Any], engine_reason: str | None, tools_called: bool) -> str | None:
    """vLLM's chat finish_reason: "tool_calls" once a tool call streamed, unless tool_choice named a function."""
    if engine_reason in ("stop", "length") and tools_called and not isinstance(body.get("tool_choice"), dict):
        return "tool_calls"
    return engine_reason


@dataclass(frozen=True, slots=True)
class Mark:
    """One chunk the client saw in full: the generated-id count before and after it, and its delta."""

    before: int
    after: int
    delta: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Cut:
    """Where a chat stream resumes: the ids kept, and the parser's state there."""

    done: int
    state: ParserState


def chat_cut(marks: list[Mark], thinking_mode: Any, greedy: bool, complete: bool = False,
             tool_index: int = 0) -> Cut:
    """The resume point of a chat stream from the chunks the client saw (vLLM parsed them: only their deltas are
    known). Chunks held back (empty delta) are regenerated. Greedy, the last text chunk is regenerated too and its
    text suppressed, so a marker inside it (`</mm:think>` in the same step as the last reasoning) is read again:
    from the answer's start when it is the first chunk shown (`complete`: `marks` begin with the answer, then the
    state there is known exactly), from the end of the chunk before it when chunks held back in between belong to
    its text (same kind), else from its own start. Otherwise the stream resumes after it, in the kind of text it
    showed. A tool call whose arguments the client has not seen is regenerated from its `<invoke>` on, its
    announcement not repeated. `marks`: the client's chunks since the last text chunk (or all), in order;
    `tool_index`: tool calls completed before them."""
    done, state, announced, seen = 0, initial_state(thinking_mode), 0, False
    first, previous = complete, None  # no chunk shown before this one; the one shown before it, and its kind
    for mark in marks:
        delta = mark.delta
        reasoning, content = delta.get("reasoning") or "", delta.get("content") or ""
        calls = delta.get("tool_calls") or []
        if reasoning or content:
            kind = "reasoning" if reasoning else "content"
            seen = seen or bool(reasoning)  # reasoning shown: the answer's `<mm:think>` (if it wrote one) is behind
            if greedy and first:
                done = 0
                state = replace(initial_state(thinking_mode), suppress_reasoning=len(reasoning),
                                suppress_content=len(content))
            elif greedy:
                joined = previous is not None and previous[1] == kind and previous[0].after < mark.before
                done = previous[0].after if joined and previous is not None else mark.before
                state = ParserState(mode=kind, suppress_reasoning=len(reasoning), suppress_content=len(content),
                                    tool_index=tool_index, think_seen=seen)
            else:
                done = mark.after
                state = ParserState(mode="content" if content else "reasoning", tool_index=tool_index,
                                    think_seen=seen)
            announced = 0
            previous = (mark, "content" if content else kind)
        for call in calls:
            function = call.get("function") or {}
            if function.get("name"):
                announced += 1
            if function.get("arguments") is not None:
                done, tool_index, announced = mark.after, tool_index + 1, max(0, announced - 1)
                state = ParserState(mode="tools", tool_index=tool_index, tools_called=True)
            previous = (mark, "tools")
        first = first and not (reasoning or content or calls)
    return Cut(done, _with_announced(state, announced))


def _with_announced(state: ParserState, announced: int) -> ParserState:
    if not announced:
        return state
    return replace(state, announced=announced, tools_called=True)
