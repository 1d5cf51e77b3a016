"""Which streams can be resumed, the body that resumes one, and where a chat stream is cut."""

from __future__ import annotations

from policies.migration import Mark, chat_cut, chat_finish_reason, nothing_left, refusal, resume_body


def test_only_streams_whose_state_lives_in_the_token_ids_are_resumable() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert refusal(chat, "chat") is None
    assert refusal({**chat, "n": 2}, "chat") == "n"
    assert refusal({**chat, "response_format": {"type": "json_schema", "json_schema": {}}}, "chat") == \
        "structured_output"
    assert refusal({**chat, "structured_outputs": {"regex": "a+"}}, "chat") == "structured_output"
    assert refusal({**chat, "include_reasoning": False}, "chat") == "include_reasoning"
    assert refusal({**chat, "return_token_ids": True}, "chat") == "token_output"
    assert refusal({"prompt": "x", "echo": True}, "completions") == "echo"
    assert refusal({"prompt": ["a", "b"]}, "completions") == "prompt"
    assert refusal({"prompt": [1, 2, 3]}, "completions") is None
    assert refusal({"input": "x"}, "responses") == "api"


def test_the_resume_body_continues_with_the_budget_left_and_the_same_sampling() -> None:
    body = {"messages": [], "max_completion_tokens": 100, "min_tokens": 10, "temperature": 0.7, "top_p": 0.9,
            "stop": ["\n\n"], "seed": 3, "tools": [{"type": "function"}], "stream_options": {"include_usage": False}}
    out = resume_body(body, "chat", "m", [1, 2, 3, 900, 901], 2)
    assert out["prompt"] == [1, 2, 3, 900, 901] and out["model"] == "m"
    assert (out["max_tokens"], out["min_tokens"]) == (98, 8)
    assert (out["temperature"], out["top_p"], out["stop"], out["seed"]) == (0.7, 0.9, ["\n\n"], 3)
    assert out["stream"] and out["return_token_ids"] and out["stream_options"] == {"include_usage": True}
    assert out["skip_special_tokens"] is False and "tools" not in out and "messages" not in out
    plain = resume_body({"prompt": "x", "min_tokens": 1}, "completions", "m", [5, 6], 4)
    assert "max_tokens" not in plain and plain["min_tokens"] == 0 and plain["skip_special_tokens"] is True


def test_nothing_is_left_once_the_budget_is_spent() -> None:
    assert nothing_left({"max_tokens": 5}, "completions", 5)
    assert not nothing_left({"max_tokens": 5}, "completions", 4)
    assert not nothing_left({}, "chat", 10_000)


def test_greedy_chat_regenerates_its_last_text_chunk_and_suppresses_it() -> None:
    marks = [Mark(0, 1, {"reasoning": "Let"}), Mark(1, 2, {"reasoning": " me"})]
    cut = chat_cut(marks, "enabled", greedy=True)
    assert cut.done == 1 and cut.state.mode == "reasoning" and cut.state.suppress_reasoning == 3
    sampled = chat_cut(marks, "enabled", greedy=False)
    assert sampled.done == 2 and sampled.state.mode == "reasoning" and sampled.state.suppress_reasoning == 0


def test_a_tool_call_without_its_arguments_is_regenerated_from_before_it_not_announced_twice() -> None:
    marks = [Mark(0, 4, {"content": "ok"}), Mark(9, 10, {"tool_calls": [{"index": 0, "id": "c",
                                                                          "function": {"name": "f"}}]})]
    cut = chat_cut(marks, None, greedy=False)
    assert cut.done == 4 and cut.state.announced == 1 and cut.state.mode == "content"
    whole = [*marks, Mark(20, 21, {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})]
    done = chat_cut(whole, None, greedy=False)
    assert done.done == 21 and done.state.mode == "tools" and done.state.tool_index == 1 and not done.state.announced


def test_a_cut_after_reasoning_was_shown_treats_a_later_opening_marker_as_text() -> None:
    """Reasoning shown means the answer's `<mm:think>` (if it wrote one) is behind: vLLM shows later ones as text."""
    marks = [Mark(1, 2, {"reasoning": "<mm:think>"}), Mark(2, 3, {"reasoning": "<mm:think>"})]
    assert chat_cut(marks, "enabled", greedy=True).state.think_seen
    assert chat_cut(marks, None, greedy=False).state.think_seen
    assert not chat_cut([Mark(0, 1, {"content": "Hi"})], None, greedy=True).state.think_seen
    assert chat_cut([], "enabled", greedy=True).state.think_seen is False


def test_nothing_seen_resumes_from_the_start_in_the_thinking_mode_state() -> None:
    assert chat_cut([], "enabled", greedy=True).state.mode == "reasoning"
    assert chat_cut([], None, greedy=True).done == 0


def test_chat_finish_reason_says_tool_calls_unless_a_function_was_named() -> None:
    assert chat_finish_reason({}, "stop", True) == "tool_calls"
    assert chat_finish_reason({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "stop", True) == "stop"
    assert chat_finish_reason({}, "length", False) == "length"


def test_the_continuation_payload_splices_the_prompt_ids_as_bytes() -> None:
    import orjson

    from policies.migration import resume_body, resume_payload

    body = {"model": "alias", "messages": [], "max_tokens": 10, "temperature": 0, "seed": 3}
    spliced = resume_payload(body, "chat", "m", b"11,12,13", [900, 901])
    assert orjson.loads(spliced) == resume_body(body, "chat", "m", [11, 12, 13, 900, 901], 2)
    assert orjson.loads(resume_payload(body, "chat", "m", b"11", []))["prompt"] == [11]


def test_greedy_the_answer_s_first_chunk_shown_is_regenerated_from_the_answer_s_start() -> None:
    """The state before the first chunk shown is the answer's initial state (its `<mm:think>`, if it writes one,
    is read again): the cut is the answer's start, that chunk's text suppressed."""
    marks = [Mark(1, 2, {"reasoning": "Let"})]  # a held-back first token, then the first text
    cut = chat_cut(marks, None, greedy=True, complete=True)
    assert cut.done == 0 and cut.state.mode == "content" and cut.state.suppress_reasoning == 3
    partial = chat_cut(marks, None, greedy=True, complete=False)  # earlier chunks unknown: regenerate this one
    assert partial.done == 1 and partial.state.mode == "reasoning"


def test_greedy_held_back_chunks_before_the_last_text_chunk_are_regenerated_with_it() -> None:
    """A held-back `]` then a chunk showing `]x`: the held piece belongs to the text (same kind), so the cut is
    before it; a change of kind means a marker was held back, so the cut is right before the last chunk."""
    same = chat_cut([Mark(0, 1, {"content": "foo"}), Mark(2, 3, {"content": "]x"})], None, greedy=True)
    assert same.done == 1 and same.state.mode == "content" and same.state.suppress_content == 2
    switched = chat_cut([Mark(0, 1, {"reasoning": "hm"}), Mark(2, 3, {"content": "The"})], "enabled",
                        greedy=True)
    assert switched.done == 2 and switched.state.mode == "content" and switched.state.suppress_content == 3
