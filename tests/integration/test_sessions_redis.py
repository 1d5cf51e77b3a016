"""Two session stores ("gateways" in one process) sharing answers through a real Redis via `RedisState`: a session
whose turns alternate between them is one session on both, with the right tool turnaround and think time.

The machine's Redis (127.0.0.1:6379, db 7) is used with a fresh key prefix per test, and only those keys are deleted.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from policies.sessions import SessionIdentity, history_keys, identify, tool_result_ids, turn_kind
from policies.snapshot import RoutingRequest
from policies.vllm_wire import usage_counts
from pools.sessions import SessionStore
from pools.shared_state import RedisState
from tests.support.shared import SHARED_REDIS, eventually


pytestmark = pytest.mark.tools("redis-server")


class Dispatches(list[tuple[str, str]]):
    """The remote dispatches a gateway applied. Recorded, not raised: RedisState catches an exception from its
    `apply_remote` callback (it counts it in `apply_errors`), so an assertion there would never reach pytest."""

    def __call__(self, pool: str, replica: str, request: RoutingRequest) -> None:
        self.append((pool, replica))


def _gateway(prefix: str, store: SessionStore | None) -> RedisState:
    return RedisState(SHARED_REDIS, Dispatches(), dict, key_prefix=prefix, sessions=store)


def assert_only_session_records(*gateways: RedisState) -> None:
    """Session records travelled, and nothing else: no dispatch was published or applied, and nothing failed."""
    for gw in gateways:
        assert isinstance(gw.apply_remote, Dispatches) and not gw.apply_remote, "a dispatch was published"
        c = gw.counters
        assert (c.errors, c.apply_errors, c.entries_received, c.entries_applied) == (0, 0, 0, 0)


class Turns:
    """One gateway's request path, reduced to the session calls the gateway makes (explicit wall-clock times)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    def request(self, body: dict, arrival: float, last_byte: float, answer_tools: tuple[str, ...] = ()):
        lookup, register = history_keys(body, "chat")
        session, source = self.store.resolve(identify({}, body, "chat"), tool_result_ids(body, "chat"), lookup,
                                             now=arrival)
        turn = self.store.begin_turn(session, turn_kind(body, "chat"), now=arrival)
        self.store.end_turn(turn, last_byte, answer_tools, register,
                            usage_counts({"prompt_tokens": 100, "completion_tokens": 5,
                                          "prompt_tokens_details": {"cached_tokens": 90}}))
        return session, source, turn


async def test_turns_alternating_between_two_gateways_are_one_session(prefix: str) -> None:
    store_a, store_b = SessionStore(shared=True), SessionStore(shared=True)
    a, b = _gateway(prefix, store_a), _gateway(prefix, store_b)
    await a.start()
    await b.start()
    try:
        u1 = {"role": "user", "content": "fix the failing test"}
        a1 = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "run", "arguments": "{}"}}]}
        t1 = {"role": "tool", "tool_call_id": "call_1", "content": "1 failed"}
        a2 = {"role": "assistant", "content": "fixed it"}
        u3 = {"role": "user", "content": "thanks, commit it"}

        t0 = time.time()
        s_a, source, _ = Turns(store_a).request({"messages": [u1]}, t0, t0 + 1.0, ("call_1",))
        assert source == "none"
        waited = await eventually(lambda: store_b.remembers(s_a.id), within=2.0)

        # turn 2 reaches B, carrying the tool's result: 0.75 s after A's answer ended
        s_b, source, turn2 = Turns(store_b).request({"messages": [u1, a1, t1]}, t0 + 1.75, t0 + 3.0)
        assert s_b.id == s_a.id and source == "tool_call"
        assert (turn2.index, turn2.wait_kind, turn2.wait_s) == (2, "tool", pytest.approx(0.75))
        await eventually(lambda: s_a.turns == 2, within=2.0)
        assert s_a.tool_s == pytest.approx(0.75) and s_a.tool_waits == 1

        # turn 3 back on A, found by its history (no tool result): 10 s of a person reading B's answer
        s_a3, source, turn3 = Turns(store_a).request({"messages": [u1, a1, t1, a2, u3]}, t0 + 13.0, t0 + 14.0)
        assert s_a3 is s_a and source == "history"
        assert (turn3.index, turn3.wait_kind, turn3.wait_s) == (3, "think", pytest.approx(10.0))
        await eventually(lambda: s_b.turns == 3, within=2.0)
        for s in (s_a, s_b):
            assert (s.turns, s.tool_waits, s.think_waits) == (3, 1, 1)
            assert s.tool_s == pytest.approx(0.75) and s.think_s == pytest.approx(10.0)
            assert s.last_end - s.started == pytest.approx(14.0) and s.prompt_tokens == 300
        # a sender counts a flush once its pipeline returns, which may be after the reader applied it
        await eventually(lambda: a.counters.session_events_sent == 2 and b.counters.session_events_sent == 1, 2.0)
        assert b.counters.session_events_received == 2 and a.counters.session_events_received == 1
        assert_only_session_records(a, b)
        print(f"answer record propagated A → B in {waited * 1000:.0f} ms")
    finally:
        await a.stop()
        await b.stop()


async def test_a_gateway_without_sessions_ignores_session_records(prefix: str) -> None:
    store = SessionStore(shared=True)
    a, b = _gateway(prefix, store), _gateway(prefix, None)
    await a.start()
    await b.start()
    try:
        session, _ = store.resolve(SessionIdentity("s", "header"))
        store.end_turn(store.begin_turn(session, "first"), None, ("c",))
        await eventually(lambda: a.counters.session_events_sent == 1, within=2.0)
        await asyncio.sleep(0.2)
        assert b.counters.session_events_received == 0
        assert_only_session_records(a, b)
    finally:
        await a.stop()
        await b.stop()
