"""The session store (pools/sessions.py) with a fake clock: first-match-wins resolution (explicit id, tool-call id,
history, new), tool turnaround and think-time arithmetic, idle expiry, final, the LRU and key bounds, warm/cold
cache paths, the admin view's redaction, and answer records exchanged between two stores without Redis."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.sessions import SessionIdentity, history_keys, identify, redacted, tool_result_ids, turn_kind
from policies.vllm_wire import usage_counts
from pools.sessions import SessionStore, decode_events, tool_key, wall_clock


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def _store(clock: Clock, **kwargs: object) -> SessionStore:
    kwargs.setdefault("id_prefix", "gen-")
    return SessionStore(clock=clock, **kwargs)  # type: ignore[arg-type]


NO_ID = SessionIdentity()


def _usage(prompt: int, cached: int, completion: int = 10) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _tokens(prompt: int, cached: int, completion: int = 10) -> tuple[int, int, int]:
    return usage_counts(_usage(prompt, cached, completion))


def test_explicit_id_is_one_session_across_requests() -> None:
    clock = Clock()
    store = _store(clock)
    a, source = store.resolve(SessionIdentity("s1", "header"))
    assert source == "header" and a.id == "s1" and a.id_source == "header"
    clock.advance(5)
    b, source = store.resolve(SessionIdentity("s1", "body"))
    assert b is a and source == "body"
    assert store.resolve(SessionIdentity("s2", "header"))[0] is not a
    assert store.counters.resolved["header"] == 2 and store.counters.sessions == 2


def test_a_sub_agent_is_a_child_session() -> None:
    store = _store(Clock())
    main, _ = store.resolve(SessionIdentity("cc", "header"))
    sub, _ = store.resolve(SessionIdentity("cc", "header", agent_id="a7"))
    assert sub is not main and sub.parent_id == "cc" and sub.agent_id == "a7"
    assert store.resolve(SessionIdentity("x", "header", parent_id="p"))[0].parent_id == "p"


def test_tool_call_ids_continue_the_answer_that_asked_and_time_the_turnaround() -> None:
    clock = Clock()
    store = _store(clock)
    session, source = store.resolve(NO_ID)
    assert source == "none" and session.id == "gen-1"
    turn = store.begin_turn(session, "first")
    assert (turn.index, turn.wait_kind) == (1, "")
    store.end_turn(turn, clock.advance(2.0), ("call_a", "call_b"), None, _tokens(1000, 0))
    clock.advance(3.5)  # the agent runs the tools
    again, source = store.resolve(NO_ID, ("call_zz", "call_b"))
    assert again is session and source == "tool_call"
    turn = store.begin_turn(again, "tool_result")
    assert (turn.index, turn.wait_kind, turn.wait_s) == (2, "tool", 3.5)
    store.end_turn(turn, clock.advance(1.0), (), None, _tokens(1100, 1000))
    clock.advance(20.0)  # a person reads the final answer
    turn = store.begin_turn(session, "user")
    assert (turn.index, turn.wait_kind, turn.wait_s) == (3, "think", 20.0)
    store.end_turn(turn, clock.advance(0.5))
    assert (session.tool_s, session.tool_waits, session.think_s, session.think_waits) == (3.5, 1, 20.0, 1)
    assert session.model_s == pytest.approx(3.5) and session.turns == 3
    assert session.last_end - session.started == pytest.approx(27.0)  # task time
    assert (session.prompt_tokens, session.cached_tokens, session.warm_turns, session.cold_turns) == (2100, 1000, 1, 1)


def test_each_answer_is_charged_once_and_tool_results_after_a_final_answer_are_not_turnaround() -> None:
    clock = Clock()
    store = _store(clock)
    session, _ = store.resolve(SessionIdentity("s", "header"))
    store.end_turn(store.begin_turn(session, "first"), clock.advance(1), ("c1",))
    clock.advance(2)
    first = store.begin_turn(session, "tool_result")
    parallel = store.begin_turn(session, "tool_result")  # a second request after the same answer
    assert (first.wait_kind, parallel.wait_kind) == ("tool", "")
    store.end_turn(first, clock.advance(1))  # a final answer (no tool calls)
    store.end_turn(parallel, clock.advance(1))
    clock.advance(1)
    assert store.begin_turn(session, "tool_result").wait_kind == ""  # nothing asked for tools
    assert session.tool_waits == 1


def test_history_chains_a_session_over_turns_and_a_tool_loop_without_ids() -> None:
    clock = Clock()
    store = _store(clock)
    sys_, u1 = {"role": "system", "content": "s"}, {"role": "user", "content": "fix it"}
    a1 = {"role": "assistant", "content": "which file?"}
    u2 = {"role": "user", "content": "main.py"}
    a2 = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "read", "arguments": "{}"}}]}
    t2 = {"role": "tool", "tool_call_id": "c1", "content": "..."}
    a3 = {"role": "assistant", "content": "fixed"}
    u4 = {"role": "user", "content": "thanks"}
    conversation = [[sys_, u1], [sys_, u1, a1, u2], [sys_, u1, a1, u2, a2, t2], [sys_, u1, a1, u2, a2, t2, a3, u4]]
    answers_tools = [(), ("c1",), (), ()]
    sessions, sources = [], []
    for messages, tools in zip(conversation, answers_tools, strict=True):
        body = {"messages": messages}
        lookup, register = history_keys(body, "chat")
        session, source = store.resolve(identify({}, body, "chat"), tool_result_ids(body, "chat"), lookup)
        turn = store.begin_turn(session, turn_kind(body, "chat"))
        store.end_turn(turn, clock.advance(1.0), tools, register)
        clock.advance(2.0)
        sessions.append(session)
        sources.append(source)
    assert all(s is sessions[0] for s in sessions)
    assert sources == ["none", "history", "tool_call", "history"]  # the tool result's id wins over its history
    assert sessions[0].turns == 4 and sessions[0].tool_waits == 1 and sessions[0].think_waits == 2


def test_tool_call_id_wins_over_history() -> None:
    clock = Clock()
    store = _store(clock)
    one, _ = store.resolve(NO_ID)
    store.end_turn(store.begin_turn(one, "first"), clock.advance(1), ("c1",), 111)
    two, _ = store.resolve(NO_ID)
    store.end_turn(store.begin_turn(two, "first"), clock.advance(1), (), 222)
    assert store.resolve(NO_ID, ("c1",), 222) == (one, "tool_call")
    assert store.resolve(NO_ID, ("unknown",), 222) == (two, "history")
    assert store.resolve(SessionIdentity("x", "header"), ("c1",), 222)[1] == "header"
    fresh, source = store.resolve(NO_ID, ("unknown",), 333)
    assert source == "none" and fresh not in (one, two)


def test_idle_sessions_end_and_a_late_request_starts_a_new_one() -> None:
    clock = Clock()
    store = _store(clock, idle_timeout_s=900)
    old, _ = store.resolve(SessionIdentity("s", "header"))
    store.end_turn(store.begin_turn(old, "first"), clock.advance(1))
    busy, _ = store.resolve(SessionIdentity("busy", "header"))
    store.begin_turn(busy, "first")  # a turn in flight: kept past the idle timeout
    clock.advance(899)
    assert store.resolve(SessionIdentity("s", "header"))[0] is old
    clock.advance(901)
    new, _ = store.resolve(SessionIdentity("s", "header"))
    assert new is not old and old.end_reason == "idle" and new.turns == 0
    store.resolve(SessionIdentity("other", "header"))
    assert store.get("busy") is busy
    clock.advance(3600 + 901)
    assert store.sweep() == 3 and store.get("busy") is None and len(store) == 0
    assert store.counters.ended["idle"] == 4


def test_final_ends_the_session_after_its_answer() -> None:
    clock = Clock()
    store = _store(clock)
    session, _ = store.resolve(SessionIdentity("s", "header"))
    store.end_turn(store.begin_turn(session, "first"), clock.advance(1))
    last, _ = store.resolve(SessionIdentity("s", "header", final=True))
    turn = store.begin_turn(last, "user")
    assert store.get("s") is session and turn.final
    store.end_turn(turn, clock.advance(1))
    assert store.get("s") is None and session.end_reason == "final"
    assert store.view()["recent"][0]["state"] == "final"
    assert store.resolve(SessionIdentity("s", "header"))[0] is not session


def test_open_sessions_are_a_bounded_lru_and_so_are_remembered_keys() -> None:
    clock = Clock()
    store = _store(clock, max_sessions=3, max_keys=4, max_recent=2)
    sessions = [store.resolve(SessionIdentity(f"s{i}", "header"), now=clock.advance(1))[0] for i in range(3)]
    store.begin_turn(sessions[0], "first")  # s0 is recent again: s1 is the least recently active
    store.resolve(SessionIdentity("s3", "header"))
    assert store.get("s1") is None and sessions[1].end_reason == "evicted" and len(store) == 3
    assert store.get("s0") is sessions[0]
    turn = store.begin_turn(sessions[2], "first")
    store.end_turn(turn, clock.advance(1), ("a", "b", "c"), 1)
    store.end_turn(store.begin_turn(sessions[2], "user"), clock.advance(1), ("d", "e"), 2)
    assert store.resolve(NO_ID, ("a",))[1] == "none"  # forgotten: 5 tool ids, at most 4 kept, at least the last 2
    assert store.resolve(NO_ID, ("d",))[0] is store.resolve(NO_ID, ("e",))[0] is sessions[2]
    assert len(store._by_tool) <= 4
    for i in range(4, 7):  # more evictions than the ended sessions kept
        store.resolve(SessionIdentity(f"s{i}", "header"))
    assert len(store.view()["recent"]) == 2  # bounded too


def test_warm_and_cold_by_cached_share_in_each_api() -> None:
    clock = Clock()
    store = _store(clock)
    session, _ = store.resolve(SessionIdentity("s", "header"))
    cases = [
        (_usage(1000, 500), "warm"),
        (_usage(1000, 499), "cold"),
        ({"input_tokens": 100, "output_tokens": 5, "input_tokens_details": {"cached_tokens": 90}}, "warm"),
        ({"input_tokens": 10, "cache_read_input_tokens": 900, "cache_creation_input_tokens": 90,
          "output_tokens": 5}, "warm"),
        ({"input_tokens": 900, "cache_read_input_tokens": 100, "output_tokens": 5}, "cold"),
        ({"prompt_tokens": 0, "completion_tokens": 1}, ""),
        (None, ""),
    ]
    for usage, expected in cases:
        assert store.end_turn(store.begin_turn(session, "user"), clock.advance(1), (), None, usage_counts(usage)) == expected
    assert usage_counts(cases[3][0]) == (1000, 5, 900)
    assert usage_counts({"prompt_tokens": -1, "prompt_tokens_details": None}) == (0, 0, 0)
    assert (session.warm_turns, session.cold_turns) == (3, 2)


def test_view_hashes_ids_and_keeps_only_the_last_turns() -> None:
    clock = Clock()
    store = _store(clock, recent_turns=2)
    session, _ = store.resolve(SessionIdentity("secret-id", "header", parent_id="parent-id"))
    for i in range(5):
        store.end_turn(store.begin_turn(session, "user"), clock.advance(1.5), ("c",) if i == 4 else (), None,
                       _tokens(100, 80))
        clock.advance(1)
    view = store.view()
    text = repr(view)
    assert "secret-id" not in text and "parent-id" not in text
    entry = view["open"][0]
    assert entry["id"] == redacted("secret-id") and entry["parent_id"] == redacted("parent-id")
    assert store.view(key=b"k")["open"][0]["id"] == redacted("secret-id", b"k")
    assert [t["index"] for t in entry["recent_turns"]] == [4, 5]
    last = entry["recent_turns"][-1]
    assert last == {"index": 5, "kind": "user", "arrival_offset_s": 10.0, "wait": "think", "wait_s": 1.0,
                    "model_s": 1.5, "prompt_tokens": 100, "completion_tokens": 10, "cached_tokens": 80,
                    "cache": "warm", "tool_calls": 1}
    assert entry["turns"] == 5 and entry["think_waits"] == 4 and entry["task_s"] == 11.5
    assert entry["cached_share"] == 0.8 and entry["warm_turns"] == 5
    assert store.view(raw_ids=True)["open"][0]["id"] == "secret-id"


# -- answer records between gateways -------------------------------------------------------------------------


def test_answer_records_round_trip_and_malformed_batches_are_rejected() -> None:
    clock = Clock()
    store = _store(clock, shared=True)
    session, _ = store.resolve(SessionIdentity("s-é", "header", parent_id="p", agent_id="a", final=True))
    turn = store.begin_turn(session, "first")
    store.end_turn(turn, clock.advance(2), ("c1", "c2"), 2**64 - 1, _tokens(10, 5, 3))
    blob, count = store.drain_events()
    assert count == 1 and store.drain_events() == (b"", 0)
    [event] = decode_events(blob)
    assert event == ("s-é/a", "header", "p", "a", 1, "first", clock.now - 2, "", 0.0, clock.now, 10, 3, 5,
                     (tool_key("c1"), tool_key("c2")), 2**64 - 1, True)
    for bad in (b"", b"\x09" + blob[1:], blob[:-3]):
        with pytest.raises((ValueError, struct.error)):
            decode_events(bad)
    assert _store(clock).drain_events() == (b"", 0)  # not shared: nothing kept to publish


def test_turns_alternating_between_two_stores_are_one_session() -> None:
    clock = Clock()
    a, b = _store(clock, shared=True, id_prefix="a-"), _store(clock, shared=True, id_prefix="b-")
    session_a, _ = a.resolve(NO_ID)
    a.end_turn(a.begin_turn(session_a, "first"), clock.advance(2), ("call_1",), 7)
    assert b.apply_events(a.drain_events()[0]) == 1
    clock.advance(4)
    session_b, source = b.resolve(NO_ID, ("call_1",))
    assert source == "tool_call" and session_b.id == session_a.id
    turn = b.begin_turn(session_b, "tool_result")
    assert (turn.index, turn.wait_kind, turn.wait_s) == (2, "tool", 4.0)
    b.end_turn(turn, clock.advance(1), (), 8)
    a.apply_events(b.drain_events()[0])
    assert session_a.turns == 2 and session_a.tool_s == 4.0 and session_a.answer_end == clock.now
    clock.advance(10)
    again, source = a.resolve(NO_ID, (), 8)
    assert again is session_a and source == "history"
    assert a.begin_turn(again, "user").wait_s == 10.0


def test_a_turn_begun_before_the_previous_answer_record_arrived_is_renumbered_and_timed() -> None:
    clock = Clock()
    a, b = _store(clock, shared=True), _store(clock, shared=True)
    ident = SessionIdentity("s", "header")
    a_s, _ = a.resolve(ident)
    a.end_turn(a.begin_turn(a_s, "first"), clock.advance(1), ("c1",))
    b.apply_events(a.drain_events()[0])
    clock.advance(1)
    b_s, _ = b.resolve(ident)
    b.end_turn(b.begin_turn(b_s, "tool_result"), clock.advance(1), ("c2",))  # turn 2 on B
    clock.advance(0.5)
    late = a.begin_turn(a_s, "tool_result")  # turn 3 reaches A before B's record: timed against turn 1's answer
    assert (late.index, late.wait_s) == (2, 2.5)
    a.apply_events(b.drain_events()[0])
    a.end_turn(late, clock.advance(1))
    assert (late.index, late.wait_kind, late.wait_s) == (3, "tool", 0.5)
    assert (a_s.turns, a_s.tool_waits, a_s.tool_s) == (3, 2, 1.5)  # turn 2's 1.0 (from B) + turn 3's 0.5


def test_wall_clock_of_a_monotonic_reading() -> None:
    assert wall_clock(100.0, now_monotonic=102.5, now_wall=1000.0) == 997.5


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_decode_events_rejects_garbage_only_with_the_documented_errors(blob: bytes) -> None:
    for data in (blob, b"\x01" + blob):
        try:
            decode_events(data)
        except (ValueError, struct.error):  # UnicodeDecodeError is a ValueError
            pass


_ops = st.lists(st.tuples(st.sampled_from(["explicit", "tool", "history", "new", "end", "advance", "final"]),
                          st.integers(0, 5)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_bounds_hold_under_any_sequence(ops: list[tuple[str, int]]) -> None:
    clock = Clock()
    store = _store(clock, max_sessions=3, max_keys=4, max_recent=2, idle_timeout_s=10, recent_turns=2)
    open_turns = []
    for op, n in ops:
        if op == "advance":
            clock.advance(n * 3)
            continue
        if op == "end":
            if open_turns:
                store.end_turn(open_turns.pop(n % len(open_turns)), clock.advance(0.5), (f"c{n}",), n,
                               _tokens(100, n * 20))
            continue
        identity = {"explicit": SessionIdentity(f"s{n}", "header"), "final": SessionIdentity(f"s{n}", "header",
                                                                                            final=True)}.get(op, NO_ID)
        session, _ = store.resolve(identity, (f"c{n}",) if op == "tool" else (), n if op == "history" else None)
        open_turns.append(store.begin_turn(session, "user"))
        assert len(store) <= 3 and len(store._by_tool) <= 4 and len(store._by_history) <= 4
    for s in list(store._open.values()) + list(store._ended):
        assert s.in_flight >= 0 and len(s.recent) <= 2 * 34 and s.tool_s >= 0 and s.think_s >= 0
    assert len(store.view()["recent"]) <= 2


def test_a_light_first_turn_is_remembered_without_a_session_and_opens_one_when_continued() -> None:
    """The gateway's path for a request that names no session and continues none (gateway/sessions.OneShotTurn):
    an id, no Session; its answer kept as a tuple under its keys; a later turn that brings one back finds a session
    with that first turn in it, timed and counted exactly as if the Session had existed all along."""
    clock = Clock()
    store = _store(clock, max_sessions=2, max_keys=64)
    assert not store.continues(("c1",), 100)
    ids = []
    for i in range(10):
        arrival = clock.advance(1)
        session_id = store.first_turn_id(arrival)
        ids.append(session_id)
        cache = store.end_first_turn(session_id, "first", arrival, clock.advance(0.5), (f"c{i}",), 100 + i,
                                     _tokens(50, 40 if i == 9 else 0), "interactive", (7, 9) if i == 9 else None)
        assert cache == ("warm", 50, 40) if i == 9 else ("cold", 50, 0)
    assert len(set(ids)) == 10 and len(store) == 0 and store.counters.resolved["none"] == 10
    assert store.counters.sessions == 0 and store.view(raw_ids=True)["open"] == []
    assert store.remembers(ids[9]) and store.continues(("c9",), None) and store.continues((), 108)
    # an answer with no keys to come back by (failed, nothing to continue) is not kept
    lost = store.first_turn_id(clock.advance(0))
    store.end_first_turn(lost, "first", clock.now, clock.advance(0.1), (), None, (0, 0, 0), "interactive", None)
    assert not store.remembers(lost)

    clock.advance(2.0)  # the tools of the last answer ran
    session, source = store.resolve(NO_ID, ("c9",))
    assert source == "tool_call" and session.id == ids[9] and store.get(session.id) is session
    assert (session.traffic_class, session.last_span, session.turns, session.unopened) == ("interactive", (7, 9), 1,
                                                                                          False)
    turn = store.begin_turn(session, "tool_result")
    assert (turn.index, turn.wait_kind) == (2, "tool") and turn.wait_s == pytest.approx(2.1)  # since c9's answer
    store.end_turn(turn, clock.advance(1.0), (), None, _tokens(80, 50))
    assert (session.turns, session.prompt_tokens, session.warm_turns, session.cold_turns) == (2, 130, 2, 0)
    described = store.view(raw_ids=True)["open"][0]
    assert [t["index"] for t in described["recent_turns"]] == [1, 2]
    assert store.resolve(NO_ID, (), 108)[1] == "history"


def test_an_unnamed_first_turn_opens_a_session_only_when_a_later_turn_continues_it() -> None:
    """One-shot requests (no id, never continued) are not sessions: they neither fill the LRU nor evict named
    sessions, nor count as ended sessions. The first turn's facts are kept, so its continuation is turn 2."""
    clock = Clock()
    ended: list[str] = []
    store = _store(clock, max_sessions=2, max_keys=64, on_end=lambda s: ended.append(s.id))
    named, _ = store.resolve(SessionIdentity("named", "header"))
    for i in range(10):  # a flood of unnamed one-shots
        session, source = store.resolve(NO_ID, (), None, clock.advance(1))
        assert source == "none" and store.get(session.id) is None
        store.end_turn(store.begin_turn(session, "first"), clock.advance(0.5), (f"c{i}",), 100 + i, _tokens(50, 0))
    assert len(store) == 1 and store.get("named") is named and ended == [] and store.counters.sessions == 1
    assert [s["id_source"] for s in store.view(raw_ids=True)["open"]] == ["header"]

    clock.advance(2.0)  # the tools of the last answer ran
    session, source = store.resolve(NO_ID, ("c9",))
    assert source == "tool_call" and store.get(session.id) is session and store.counters.sessions == 2
    turn = store.begin_turn(session, "tool_result")
    assert (turn.index, turn.wait_kind, turn.wait_s) == (2, "tool", 2.0)
    store.end_turn(turn, clock.advance(1.0), (), None, _tokens(80, 50))
    assert (session.turns, session.prompt_tokens, session.warm_turns, session.cold_turns) == (2, 130, 1, 1)
    # and by history key: the one before (kept: at least max_sessions / 2 answered first turns are)
    assert store.resolve(NO_ID, (), 108)[1] == "history"
    assert store.resolve(NO_ID, (), 12345)[1] == "none"  # never registered
