"""policies/collected.py: a non-streamed answer from the events of the stream sent instead (the shapes against the
simulator's own non-streamed answers are checked through a gateway in test_background_lane_gateway.py)."""

from __future__ import annotations

import orjson

from policies.collected import answer_from_events

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def _sse(*chunks: object) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _delta(delta: dict, finish: str | None = None) -> dict:
    return {**HEAD, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def test_deltas_join_into_one_message_and_comments_are_skipped() -> None:
    events = _sse(_delta({"role": "assistant", "content": ""}), _delta({"reasoning": "think "}),
                  _delta({"reasoning": "hard"}), _delta({"content": "Hello"}))
    events += b": paused\n\n" + _sse(
        _delta({"content": " world"}, "stop"),
        {**HEAD, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                          "prompt_tokens_details": {"cached_tokens": 0}},
         "system_fingerprint": "fp"})
    status, body = answer_from_events(events, "chat")
    answer = orjson.loads(body)
    assert status == 200 and answer["object"] == "chat.completion" and answer["id"] == "chatcmpl-1"
    message = answer["choices"][0]["message"]
    assert (message["role"], message["content"], message["reasoning"]) == ("assistant", "Hello world", "think hard")
    assert "tool_calls" not in message and answer["choices"][0]["finish_reason"] == "stop"
    assert answer["system_fingerprint"] == "fp"
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "multimodal_tokens": None}


def test_tool_call_deltas_merge_by_index() -> None:
    events = _sse(
        _delta({"role": "assistant", "content": ""}),
        _delta({"tool_calls": [{"index": 0, "id": "call-a", "type": "function", "function": {"name": "read"}}]}),
        _delta({"tool_calls": [{"index": 1, "id": "call-b", "type": "function", "function": {"name": "run"}}]}),
        _delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"pa'}}]}),
        _delta({"tool_calls": [{"index": 0, "function": {"arguments": 'th": 1}'}}]}, "tool_calls"))
    message = orjson.loads(answer_from_events(events, "chat")[1])["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"id": "call-a", "type": "function", "function": {"name": "read", "arguments": '{"path": 1}'}},
        {"id": "call-b", "type": "function", "function": {"name": "run", "arguments": ""}}]


def test_completions_text_joins() -> None:
    head = {**HEAD, "object": "text_completion"}
    events = _sse({**head, "choices": [{"index": 0, "text": "Once", "finish_reason": None}]},
                  {**head, "choices": [{"index": 0, "text": " upon", "finish_reason": "length", "stop_reason": None}]})
    answer = orjson.loads(answer_from_events(events, "completions")[1])
    assert answer["object"] == "text_completion" and answer["choices"][0]["text"] == "Once upon"
    assert answer["choices"][0]["finish_reason"] == "length"


def test_a_stream_that_ended_in_an_error_is_that_error() -> None:
    events = _sse(_delta({"role": "assistant", "content": ""}), _delta({"content": "par"}),
                  {"error": {"message": "the replica failed mid-stream", "type": "upstream_error", "param": None,
                             "code": 502}})
    status, body = answer_from_events(events, "chat")
    assert status == 502
    assert orjson.loads(body) == {"error": {"message": "the replica failed mid-stream", "type": "upstream_error",
                                            "param": None, "code": 502}}
    status, body = answer_from_events(b"", "chat")
    assert status == 502 and orjson.loads(body)["error"]["type"] == "upstream_error"
