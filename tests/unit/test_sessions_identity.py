"""Session identity (policies/sessions.py): explicit ids from headers and body in precedence order, caps and
redaction, tool-call ids in the three APIs' requests and answers (streamed ones split anywhere), history keys that
chain turn to turn, and the kind of each turn."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.datastructures import Headers

from policies.sessions import (
    MAX_ID_CHARS,
    SESSION_HEADERS,
    SessionIdentity,
    SseToolCallScanner,
    answer_tool_call_ids,
    cap_id,
    history_keys,
    identify,
    redacted,
    tool_result_ids,
    turn_facts,
    turn_facts_and_keys,
    turn_kind,
)


def _headers(**values: str) -> Headers:
    return Headers({k.replace("_", "-"): v for k, v in values.items()})


# -- explicit ids ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SESSION_HEADERS)
def test_each_session_header_names_the_session(name: str) -> None:
    got = identify(Headers({name: "s-1"}), {}, "chat")
    assert (got.id, got.id_source) == ("s-1", "header")


def test_headers_win_in_their_order_and_over_the_body() -> None:
    headers = {name: f"id-{i}" for i, name in enumerate(SESSION_HEADERS)}
    body = {"session_id": "b", "user": "u"}
    for i in range(len(SESSION_HEADERS)):
        got = identify(Headers({k: v for k, v in headers.items() if int(v[3:]) >= i}), body, "chat")
        assert (got.id, got.id_source) == (f"id-{i}", "header")


def test_header_names_are_case_insensitive_and_blank_values_do_not_count() -> None:
    got = identify(Headers({"X-Session-Id": "  ", "X-Dynamo-Session-Id": "dyn"}), {}, "chat")
    assert got.id == "dyn"
    assert identify({"x-session-id": "lower"}, {}, "chat").id == "lower"  # a plain dict with lower-case names


@pytest.mark.parametrize(("body", "expected"), [
    ({"session_id": "a", "metadata": {"session_id": "b"}, "user": "c"}, "a"),
    ({"metadata": {"session_id": "b"}, "user": "c"}, "b"),
    ({"user": "c"}, "c"),
    ({"session_id": 5, "metadata": {"session_id": ["x"]}, "user": "c"}, "c"),  # strings only
    ({"metadata": "not a dict", "user": {"id": 1}}, None),
    ({}, None),
])
def test_body_fields_in_order_strings_only(body: dict, expected: str | None) -> None:
    got = identify(Headers({}), body, "chat")
    assert got.id == expected
    assert got.id_source == ("body" if expected else "none")


def test_claude_code_sub_agent_parent_links_and_final() -> None:
    got = identify(_headers(x_claude_code_session_id="cc", x_claude_code_agent_id="agent-7",
                            x_dynamo_parent_session_id="p2", x_parent_session_id="p1",
                            x_dynamo_session_final="True"), {}, "messages")
    assert got == SessionIdentity("cc", "header", parent_id="p1", agent_id="agent-7", final=True)
    assert identify(_headers(x_dynamo_parent_session_id="p2"), {}, "chat").parent_id == "p2"
    assert identify(_headers(x_dynamo_session_final="false"), {}, "chat").final is False


def test_long_ids_are_replaced_by_a_short_stable_hash() -> None:
    long = "x" * (MAX_ID_CHARS + 1)
    got = identify(_headers(x_session_id=long, x_parent_session_id=long + "p"), {}, "chat")
    assert got.id == cap_id(long) and len(got.id) == 33 and got.id.startswith("~")
    assert got.id != long and got.parent_id != got.id
    assert identify(Headers({}), {"user": long}, "chat").id == got.id  # stable: same id wherever it came from
    assert cap_id("x" * MAX_ID_CHARS) == "x" * MAX_ID_CHARS


def test_redacted_is_a_stable_sha256_prefix_keyed_on_request() -> None:
    assert redacted("s-1") == redacted("s-1") != redacted("s-2")
    assert len(redacted("s-1")) == 16 and "s-1" not in redacted("s-1")
    assert redacted("s-1", key=b"k1") != redacted("s-1", key=b"k2") != redacted("s-1")
    assert len(redacted("s-1", length=64)) == 64


# -- tool results in requests ------------------------------------------------------------------------------------


def test_chat_tool_results_are_the_trailing_tool_messages() -> None:
    body = {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "old", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "old", "content": "1"},
        {"role": "assistant", "tool_calls": [{"id": "c1"}, {"id": "c2"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a"},
        {"role": "tool", "tool_call_id": "c2", "content": "b"},
    ]}
    assert tool_result_ids(body, "chat") == ("c2", "c1")
    assert turn_kind(body, "chat") == "tool_result"
    body["messages"].append({"role": "user", "content": "<system-reminder>tests pass</system-reminder>"})
    assert tool_result_ids(body, "chat") == ("c2", "c1")  # a note appended after the results
    assert turn_kind(body, "chat") == "tool_result"
    body["messages"][-3:] = [{"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}]
    assert tool_result_ids(body, "chat") == ()
    assert turn_kind(body, "chat") == "user"
    assert turn_kind({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}, {"role": "tool"}]},
                     "chat") == "tool_result"  # a result without an id is still one


def test_responses_function_call_outputs_even_interleaved_with_their_calls() -> None:
    body = {"input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a"},
        {"type": "function_call_output", "call_id": "c2", "output": "b"},
    ]}
    assert tool_result_ids(body, "responses") == ("c2", "c1")
    body["input"][3:5] = [body["input"][4], body["input"][3]]  # fc c1, fco c1, fc c2, fco c2
    assert set(tool_result_ids(body, "responses")) == {"c1", "c2"}
    assert turn_kind(body, "responses") == "tool_result"
    body["input"].append({"role": "user", "content": "also check b"})
    assert set(tool_result_ids(body, "responses")) == {"c1", "c2"}
    assert turn_kind({"input": "hello"}, "responses") == "first"
    assert tool_result_ids({"input": "hello"}, "responses") == ()


def test_anthropic_tool_results_are_in_the_last_user_message() -> None:
    body = {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                                          {"type": "tool_use", "id": "t2", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a"},
                                     {"type": "tool_result", "tool_use_id": "t2", "content": "b"},
                                     {"type": "text", "text": "go on"}]},
    ]}
    assert tool_result_ids(body, "messages") == ("t2", "t1")
    assert turn_kind(body, "messages") == "tool_result"
    assert turn_kind({"messages": [{"role": "user", "content": "hi"}]}, "messages") == "first"


@pytest.mark.parametrize("body", [{}, {"messages": "x"}, {"messages": [None, 3, {"role": "tool"}]},
                                  {"input": [{"type": "function_call_output", "call_id": 7}]}])
def test_odd_requests_have_no_tool_results_and_never_raise(body: dict) -> None:
    for api in ("chat", "completions", "responses", "messages"):
        assert tool_result_ids(body, api) == ()
        turn_kind(body, api)
        history_keys(body, api)
        turn_facts_and_keys(body, api)


_ITEM = st.one_of(
    st.none(), st.integers(-9, 9), st.text(max_size=3),  # bodies come from orjson: 64-bit integers at most
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system", "developer", 7])},
                          optional={"content": st.one_of(st.text(max_size=5), st.lists(st.fixed_dictionaries(
                              {"type": st.sampled_from(["text", "tool_result", "thinking"])},
                              optional={"text": st.text(max_size=3), "tool_use_id": st.text(max_size=3)}),
                              max_size=2)),
                                    "tool_call_id": st.one_of(st.text(max_size=3), st.integers(-9, 9)),
                                    "tool_calls": st.lists(st.fixed_dictionaries({"id": st.text(max_size=3)}),
                                                           max_size=2),
                                    "type": st.sampled_from(["message", "function_call", "function_call_output",
                                                             "reasoning", None]),
                                    "call_id": st.text(max_size=3)}))


@settings(max_examples=300, deadline=None)
@given(items=st.lists(_ITEM, max_size=6), api=st.sampled_from(["chat", "completions", "responses", "messages"]),
       system=st.one_of(st.none(), st.text(max_size=3)), scope=st.sampled_from(["", "key-a"]))
def test_the_one_walk_gives_what_turn_facts_and_history_keys_give(items: list, api: str, system: str | None,
                                                                  scope: str) -> None:
    body: dict = {"input" if api == "responses" else "messages": items}
    if system is not None:
        body["instructions" if api == "responses" else "system"] = system
    kind, ids = turn_facts(body, api)
    assert turn_facts_and_keys(body, api, scope) == (kind, ids, *history_keys(body, api, scope))


# -- history keys ------------------------------------------------------------------------------------------------


def test_chat_history_chains_over_turns_with_a_tool_loop() -> None:
    sys_, u1 = {"role": "system", "content": "be brief"}, {"role": "user", "content": "fix the bug"}
    a1 = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{\"p\": 1}"}}]}
    t1 = {"role": "tool", "tool_call_id": "c1", "content": "file"}
    a2 = {"role": "assistant", "content": "done"}
    u2 = {"role": "user", "content": "thanks, now the test"}
    a3 = {"role": "assistant", "content": "ok"}
    u3 = {"role": "user", "content": "bye"}
    turns = [[sys_, u1], [sys_, u1, a1, t1], [sys_, u1, a1, t1, a2, u2], [sys_, u1, a1, t1, a2, u2, a3, u3]]
    keys = [history_keys({"messages": m}, "chat") for m in turns]
    assert keys[0][0] is None
    for previous, current in itertools.pairwise(keys):
        assert current[0] == previous[1]  # this turn's lookup == the previous turn's register
    assert len({k[1] for k in keys}) == 4
    # the client echoes the assistant's tool call with extra fields and an index: still the same history
    a1_echo = {"role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "read", "arguments": "{\"p\": 1}"}}]}
    assert history_keys({"messages": [sys_, u1, a1_echo, t1, a2, u2]}, "chat") == keys[2]


def test_a_history_that_starts_with_the_model_has_nothing_to_look_up() -> None:
    body = {"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]}
    assert history_keys(body, "chat")[0] is None
    assert history_keys({"system": "s", **body}, "messages")[0] is not None


def test_history_scope_separates_tenants_and_content_changes_the_key() -> None:
    body = {"messages": [{"role": "user", "content": "hello"}]}
    assert history_keys(body, "chat", scope="key-a") != history_keys(body, "chat", scope="key-b")
    assert history_keys(body, "chat") != history_keys({"messages": [{"role": "user", "content": "hello!"}]}, "chat")
    # a string and a single text part are the same content
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert history_keys(parts, "chat") == history_keys(body, "chat")


def test_responses_history_chains_with_instructions_and_function_calls() -> None:
    u1 = {"role": "user", "content": "list files"}
    fc = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "ls", "arguments": "{}"}
    rs = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "zz"}
    fco = {"type": "function_call_output", "call_id": "c1", "output": "a b"}
    msg = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a and b"}]}
    u2 = {"role": "user", "content": "thanks"}
    turns = [[u1], [u1, rs, fc, fco], [u1, rs, fc, fco, msg, u2]]
    keys = [history_keys({"instructions": "be brief", "input": t}, "responses") for t in turns]
    assert keys[1][0] == keys[0][1] and keys[2][0] == keys[1][1]
    assert history_keys({"instructions": "be brief", "input": "list files"}, "responses")[1] == keys[0][1]
    assert history_keys({"input": [u1]}, "responses") != keys[0]  # the instructions count
    # reasoning items may be dropped by the client on later turns
    assert history_keys({"instructions": "be brief", "input": [u1, fc, fco, msg, u2]}, "responses") == keys[2]


def test_anthropic_history_chains_ignoring_cache_control_and_thinking() -> None:
    system = [{"type": "text", "text": "you are claude code", "cache_control": {"type": "ephemeral"}}]
    u1 = {"role": "user", "content": [{"type": "text", "text": "fix it", "cache_control": {"type": "ephemeral"}}]}
    a1 = {"role": "assistant", "content": [{"type": "thinking", "thinking": "...", "signature": "s"},
                                           {"type": "tool_use", "id": "t1", "name": "read", "input": {"p": 1}}]}
    r1 = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x",
                                       "cache_control": {"type": "ephemeral"}}]}
    a2 = {"role": "assistant", "content": [{"type": "text", "text": "fixed"}]}
    u2 = {"role": "user", "content": "thanks"}
    k1 = history_keys({"system": system, "messages": [u1]}, "messages")
    # turn 2: the cache marker moved from u1 to r1, the thinking block was stripped by the client
    u1_plain = {"role": "user", "content": [{"type": "text", "text": "fix it"}]}
    a1_bare = {"role": "assistant", "content": [a1["content"][1]]}
    k2 = history_keys({"system": system, "messages": [u1_plain, a1, r1]}, "messages")
    k3 = history_keys({"system": "you are claude code", "messages": [u1_plain, a1_bare, r1, a2, u2]}, "messages")
    assert k2[0] == k1[1] and k3[0] == k2[1]


# -- tool calls in answers ---------------------------------------------------------------------------------------


def test_non_streamed_answers_tool_call_ids() -> None:
    chat = orjson.dumps({"choices": [{"message": {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}, {"id": "c2"}]}}]})
    responses = orjson.dumps({"output": [{"type": "reasoning"}, {"type": "function_call", "call_id": "c9",
                                                                 "id": "fc_1"}]})
    messages = orjson.dumps({"content": [{"type": "text", "text": "x"}, {"type": "tool_use", "id": "t1"}]})
    assert answer_tool_call_ids(chat, "chat") == ("c1", "c2")
    assert answer_tool_call_ids(responses, "responses") == ("c9",)
    assert answer_tool_call_ids(messages, "messages") == ("t1",)
    assert answer_tool_call_ids(b'{"choices": [{"message": {"content": "tool_calls"}}]}', "chat") == ()
    assert answer_tool_call_ids(b'"tool_calls" not json', "chat") == ()
    assert answer_tool_call_ids(chat, "completions") == ()


def _sse(obj: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


CHAT_STREAM = b"".join([
    _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    _sse({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]}}]}),
    _sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}),
    _sse({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": ""}}]}}]}),
    _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
    b"data: [DONE]\n\n",
])
RESPONSES_STREAM = b"".join([
    _sse({"type": "response.created", "response": {"id": "resp_1"}}, "response.created"),
    _sse({"type": "response.output_item.added", "output_index": 0,
          "item": {"type": "function_call", "id": "fc_1", "call_id": "call_r", "name": "f", "arguments": ""}},
         "response.output_item.added"),
    _sse({"type": "response.function_call_arguments.delta", "delta": "{}"}, "response.function_call_arguments.delta"),
    _sse({"type": "response.output_item.done", "output_index": 0,
          "item": {"type": "function_call", "id": "fc_1", "call_id": "call_r", "name": "f", "arguments": "{}"}},
         "response.output_item.done"),
])
MESSAGES_STREAM = b"".join([
    _sse({"type": "message_start", "message": {"id": "msg_1", "content": []}}, "message_start"),
    _sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
         "content_block_start"),
    _sse({"type": "content_block_start", "index": 1,
          "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}}, "content_block_start"),
    _sse({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{}"}},
         "content_block_delta"),
    _sse({"type": "message_delta", "delta": {"stop_reason": "tool_use"}}, "message_delta"),
])


@pytest.mark.parametrize(("api", "stream", "expected"), [
    ("chat", CHAT_STREAM, ("call_a", "call_b")),
    ("responses", RESPONSES_STREAM, ("call_r",)),
    ("messages", MESSAGES_STREAM, ("toolu_1",)),
])
def test_sse_scanner_finds_ids_however_the_stream_is_split(api: str, stream: bytes, expected: tuple) -> None:
    whole = SseToolCallScanner(api)
    whole.feed(stream)
    assert whole.ids == expected
    for size in (1, 2, 3, 7, 13, 64, 200):  # every split point at these strides, markers cut in two included
        scanner = SseToolCallScanner(api)
        for i in range(0, len(stream), size):
            scanner.feed(stream[i:i + size])
        assert scanner.ids == expected, size
    for cut in range(1, len(stream)):
        scanner = SseToolCallScanner(api)
        scanner.feed(stream[:cut])
        scanner.feed(stream[cut:])
        assert scanner.ids == expected, cut


def test_sse_scanner_ignores_text_and_bounds_what_it_keeps() -> None:
    scanner = SseToolCallScanner("chat", max_carry=32)
    scanner.feed(_sse({"choices": [{"delta": {"content": "about tool_calls"}}]}))
    scanner.feed(b"data: " + b"x" * 100)  # an event longer than max_carry, cut: dropped, not buffered
    assert scanner.ids == () and scanner.overflowed == 1
    plain = SseToolCallScanner("completions")
    plain.feed(CHAT_STREAM)
    assert plain.ids == ()


_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.sampled_from(["role", "content", "type", "tool_calls", "tool_call_id", "call_id", "id",
                                          "tool_use_id", "text", "messages", "input", "system", "function"]),
                         inner, max_size=5), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["messages", "input", "system", "instructions", "prompt", "user",
                                             "session_id", "metadata"]), _json, max_size=4))
def test_odd_json_never_raises(body: dict) -> None:
    for api in ("chat", "completions", "responses", "messages"):
        identify({}, body, api)
        tool_result_ids(body, api)
        turn_kind(body, api)
        history_keys(body, api)
        turn_facts_and_keys(body, api)
        raw = orjson.dumps(body)
        answer_tool_call_ids(raw, api)
        scanner = SseToolCallScanner(api)
        scanner.feed(b"data: " + raw + b"\n\n")
