"""Greedy answers are a function of the context, so a stream cut after j tokens and resumed on another replica from
(prompt ids + the j generated ids) through /v1/completions continues exactly; `return_token_ids` as vLLM 0.32 sends it.
Two separate simulator processes, real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}]


@pytest.fixture(scope="module")
def pair() -> Iterator[list[SimProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--instant"]},
                       {"max_model_len": 8192, "extra_args": ["--instant"]}]) as sims:
        yield sims


def events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def stream_ids(chunks: list[dict[str, Any]]) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, raw text) of a return_token_ids stream."""
    prompt = next(c.get("prompt_token_ids") or c["choices"][0]["prompt_token_ids"] for c in chunks
                  if c.get("prompt_token_ids") or (c["choices"] and c["choices"][0].get("prompt_token_ids")))
    ids: list[int] = []
    text = ""
    for c in chunks:
        for choice in c["choices"]:
            ids += choice.get("token_ids") or []
            text += choice.get("text") or ""
    return prompt, ids, text


def resume(url: str, prompt: list[int], done: list[int], max_tokens: int,
           **sampling: Any) -> tuple[list[int], str, str]:
    """What a gateway sends to resume: the same sampling parameters, max_tokens less what was generated."""
    chunks = events(url, "/v1/completions", {"model": MODEL, "prompt": prompt + done, "max_tokens": max_tokens,
                                              "temperature": 0, "return_token_ids": True, **sampling})
    _, ids, text = stream_ids(chunks)
    finish = next(ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"])
    return ids, text, finish


def test_a_completion_resumed_from_token_ids_on_another_replica_continues_exactly(pair: list[SimProcess]) -> None:
    a, b = pair
    body = {"model": MODEL, "prompt": "Write a story about ships.", "max_tokens": 40, "temperature": 0,
            "return_token_ids": True}
    prompt, ids, text = stream_ids(events(a.url, "/v1/completions", body))
    assert len(ids) == 40 and len(set(ids)) > 1
    for j in (1, 7, 39):
        rest, rest_text, finish = resume(b.url, prompt, ids[:j], 40 - j)
        assert rest == ids[j:]
        assert finish == "length"
        pieces = [c["choices"][0]["text"] for c in events(a.url, "/v1/completions", body)]
        assert rest_text == "".join(pieces[j:])


def test_a_chat_answer_with_reasoning_resumes_through_completions(pair: list[SimProcess]) -> None:
    a, b = pair
    body = {"model": MODEL, "messages": [{"role": "user", "content": "think, then answer"}], "max_tokens": 60,
            "ignore_eos": True, "temperature": 0, "return_token_ids": True,
            "chat_template_kwargs": {"thinking_mode": "enabled"}}
    chunks = events(a.url, "/v1/chat/completions", body)
    prompt, ids, _ = stream_ids(chunks)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert reasoning and content and len(ids) == 60
    done = 3  # cut inside the reasoning
    rest, raw, finish = resume(b.url, prompt, ids[:done], 60 - done, ignore_eos=True)
    assert rest == ids[done:] and finish == "length"
    head, marker, tail = raw.partition("</mm:think>")
    assert marker and reasoning.endswith(head) and tail == content  # the raw text a reasoning parser splits


def test_a_chat_tool_call_resumes_as_its_native_markup(pair: list[SimProcess]) -> None:
    a, b = pair
    messages = [{"role": "user", "content": "weather in Paris?"}]
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400,
            "temperature": 0, "return_token_ids": True}
    chunks = events(a.url, "/v1/chat/completions", body)
    prompt, ids, _ = stream_ids(chunks)
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    args = json.loads(next(tc["function"]["arguments"] for tc in calls if tc["function"].get("arguments")))
    # The resuming replica reads the tools from the prompt once it has rendered it (/tokenize, as a gateway does).
    tokenized = httpx.post(b.url + "/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS},
                           timeout=10).json()
    assert tokenized["tokens"] == prompt
    done = len(ids) // 2
    rest, raw, finish = resume(b.url, prompt, ids[:done], 400 - done)
    assert rest == ids[done:] and finish == "stop"
    assert raw.endswith("]<]minimax[>[</tool_call>") and f"<days>{args['days']}" in raw


def test_a_tool_call_resumes_where_the_prompt_was_never_seen_when_the_tools_come_along(
        pair: list[SimProcess]) -> None:
    """Without /tokenize there, the built-in tokenizer cannot read the tools back from ids; the `tools` field, which
    vLLM's /v1/completions ignores, stands in for them."""
    a, b = pair
    tools = [{"type": "function", "function": {"name": "book_table", "parameters": {
        "type": "object", "properties": {"guests": {"type": "integer"}, "place": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "a table for two in Rome, please"}]
    body = {"model": MODEL, "messages": messages, "tools": tools, "tool_choice": "required", "max_tokens": 400,
            "temperature": 0, "return_token_ids": True, "chat_template_kwargs": {"thinking_mode": "enabled"}}
    prompt, ids, _ = stream_ids(events(a.url, "/v1/chat/completions", body))
    _, without, _ = resume(b.url, prompt, ids[:2], 398)
    assert "<tool_call>" not in without  # the tools could not be read: no tool call planned
    rest, raw, finish = resume(b.url, prompt, ids[:2], 398, tools=tools)
    assert rest == ids[2:] and finish == "stop" and raw.endswith("]<]minimax[>[</tool_call>")


def test_return_token_ids_shapes_match_vllm(pair: list[SimProcess]) -> None:
    a, _ = pair
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True,
            "return_token_ids": True}
    chunks = events(a.url, "/v1/chat/completions", chat)
    role, rest = chunks[0], chunks[1:]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert isinstance(role["prompt_token_ids"], list) and role["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in rest)
    assert [len(c["choices"][0]["token_ids"]) for c in rest] == [1] * 5
    plain = events(a.url, "/v1/chat/completions", {**chat, "return_token_ids": False})
    assert plain[0]["prompt_token_ids"] is None and all(c["choices"][0]["token_ids"] is None for c in plain[1:])
    hidden = events(a.url, "/v1/chat/completions", {**chat, "include_reasoning": False})
    assert all(c["choices"][0].get("token_ids") is None for c in hidden[1:])
    assert all(c["choices"][0]["delta"]["reasoning"] is None for c in hidden[1:] if c["choices"][0]["delta"])

    unary = httpx.post(a.url + "/v1/chat/completions", json=chat, timeout=10).json()
    assert unary["prompt_token_ids"] == role["prompt_token_ids"]
    assert unary["choices"][0]["token_ids"] == [c["choices"][0]["token_ids"][0] for c in rest]

    comp = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    chunks = events(a.url, "/v1/completions", comp)
    first = chunks[0]["choices"][0]
    assert first["prompt_token_ids"] and len(first["token_ids"]) == 1 and first["text"]
    assert all(c["choices"][0]["prompt_token_ids"] is None and len(c["choices"][0]["token_ids"]) == 1
               for c in chunks[1:])
    body = httpx.post(a.url + "/v1/completions", json=comp, timeout=10).json()["choices"][0]
    assert body["prompt_token_ids"] == first["prompt_token_ids"] and len(body["token_ids"]) == 4


def sse_events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as resp:
        return [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: ")]


def test_messages_and_responses_answers_are_the_chat_answer_and_resume_the_same_way(
        pair: list[SimProcess]) -> None:
    """vLLM serves both through its chat path; greedy, the sim gives the chat answer of the same conversation, so a
    gateway can resume them from the chat prompt's ids (/tokenize) plus the generated ids."""
    a, b = pair
    messages = [{"role": "user", "content": "plan a trip"}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 50, "temperature": 0, "return_token_ids": True,
            "chat_template_kwargs": {"thinking_mode": "enabled"}}
    chunks = events(a.url, "/v1/chat/completions", chat)
    prompt, ids, _ = stream_ids(chunks)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])

    anthropic = sse_events(a.url, "/v1/messages", {"model": MODEL, "messages": messages, "max_tokens": 50,
                                                   "temperature": 0, "thinking": {"type": "enabled"}})
    deltas = [e["delta"] for e in anthropic if e.get("type") == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == reasoning
    assert "".join(d.get("text", "") for d in deltas) == content
    responses = sse_events(a.url, "/v1/responses", {"model": MODEL, "input": messages, "max_output_tokens": 50,
                                                    "temperature": 0,
                                                    "chat_template_kwargs": {"thinking_mode": "enabled"}})
    assert "".join(e.get("delta", "") for e in responses if e["type"] == "response.output_text.delta") == content

    tokenized = httpx.post(b.url + "/tokenize", json={"model": MODEL, "messages": messages,
                                                      "chat_template_kwargs": {"thinking_mode": "enabled"}},
                           timeout=10).json()
    assert tokenized["tokens"] == prompt
    rest, raw, _ = resume(b.url, tokenized["tokens"], ids[:10], 40)
    assert rest == ids[10:] and (reasoning + "</mm:think>" + content).endswith(raw)
