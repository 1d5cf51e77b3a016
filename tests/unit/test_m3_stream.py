"""The M3 raw-text parser that turns a resumed chat stream's `/v1/completions` text back into chat deltas."""

from __future__ import annotations

import json
from typing import Any

from policies.m3_stream import (
    M3StreamParser,
    ParserState,
    convert_arguments,
    initial_state,
)

TAG = "]<]minimax[>["
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "hot": {"type": "boolean"}}}}}]
CALL = (f'{TAG}<tool_call>{TAG}<invoke name="get_weather">{TAG}<city>Paris{TAG}</city>{TAG}<days>3{TAG}</days>'
        f"{TAG}</invoke>{TAG}</tool_call>")


def run(text: str, state: ParserState, step: int = 1) -> dict[str, Any]:
    """The parser fed `text` `step` characters at a time; everything it emitted, merged."""
    parser = M3StreamParser(state, TOOLS)
    out: dict[str, Any] = {"reasoning": "", "content": "", "tool_calls": []}
    deltas = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    for delta in deltas:
        out["reasoning"] += delta.get("reasoning", "")
        out["content"] += delta.get("content", "")
        out["tool_calls"] += delta.get("tool_calls", [])
    out["state"] = parser.state
    return out


def test_reasoning_ends_at_the_marker_however_the_text_is_split() -> None:
    text = "step by step</mm:think>The answer."
    for step in (1, 3, 7, len(text)):
        out = run(text, initial_state("enabled"), step)
        assert (out["reasoning"], out["content"]) == ("step by step", "The answer."), step


def test_content_turns_into_reasoning_at_the_opening_marker() -> None:
    out = run("Hi<mm:think>hmm</mm:think>there", initial_state(None), 2)
    assert (out["reasoning"], out["content"]) == ("hmm", "Hithere")


def test_only_the_answers_first_opening_marker_is_a_marker() -> None:
    """As vLLM's M3 reasoning parser splits the answer (it partitions at the first `<mm:think>`): the tiny real test
    model, thinking enabled, writes the marker again and again, and vLLM shows the repeats as reasoning text."""
    text = "<mm:think>a<mm:think>b</mm:think>c<mm:think>d"
    for step in (1, 4, len(text)):
        out = run(text, initial_state("enabled"), step)
        assert (out["reasoning"], out["content"]) == ("a<mm:think>b", "c<mm:think>d"), step


def test_a_stream_resumed_inside_reasoning_keeps_later_markers_as_text() -> None:
    out = run("<mm:think><mm:think></mm:think>x", ParserState(mode="reasoning", think_seen=True), 3)
    assert (out["reasoning"], out["content"]) == ("<mm:think><mm:think>", "x")


def test_a_tool_call_is_announced_then_its_arguments_typed_by_the_schema() -> None:
    out = run("Let me check." + CALL + "ignored trailing text", initial_state(None), 5)
    assert out["content"] == "Let me check."
    header, args = out["tool_calls"]
    assert header["function"] == {"name": "get_weather"} and header["index"] == 0 and header["id"]
    assert args["index"] == 0 and json.loads(args["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert out["state"].tools_called and out["state"].mode == "done"


def test_a_call_the_client_already_saw_announced_is_not_announced_again() -> None:
    out = run(CALL, ParserState(mode="content", announced=1), 4)
    assert len(out["tool_calls"]) == 1 and "name" not in out["tool_calls"][0]["function"]


def test_text_the_client_already_saw_is_suppressed() -> None:
    out = run("word</mm:think>next", ParserState(mode="reasoning", suppress_reasoning=4))
    assert (out["reasoning"], out["content"]) == ("", "next")


def test_an_unfinished_marker_at_the_end_is_text_after_all() -> None:
    out = run("cost ]<]mini", initial_state(None))
    assert out["content"] == "cost ]<]mini"


def test_a_parser_holding_an_unfinished_invoke_is_not_at_a_clean_point() -> None:
    parser = M3StreamParser(initial_state(None), TOOLS)
    parser.feed(CALL[:60])
    assert not parser.clean
    parser.feed(CALL[60:])
    assert parser.clean


def test_arguments_convert_as_vllm_does_nested_repeated_and_typed() -> None:
    raw = (f"{TAG}<tags>{TAG}<item>a{TAG}</item>{TAG}<item>b{TAG}</item>{TAG}</tags>{TAG}<hot>true{TAG}</hot>"
           f"{TAG}<extra>x{TAG}</extra>{TAG}<extra>y{TAG}</extra>")
    props = TOOLS[0]["function"]["parameters"]["properties"]
    assert json.loads(convert_arguments(raw, props)) == {"tags": ["a", "b"], "hot": True, "extra": ["x", "y"]}
    assert convert_arguments(f"{TAG}<days>3", props) == "{}"  # unterminated: nothing before it, nothing kept
