"""Agent sessions as one collaborator of the coordinator: which session a request belongs to, its turn, and what its
answer tells the next turn.

    begin(record, headers, body, api)   at arrival: identity (policies/sessions.py) → session and turn (pools/sessions.py)
    scanner                             during a stream: the answer's tool-call ids, from the SSE bytes as they pass
    end(record)                         once, however the request ended: the answer's last byte, tool calls, usage

The identity is what sticky routing keys on too. Ids never reach logs or metric labels; spans show them hashed unless
`sessions.trace_ids: raw`. Inference costs are paid only when needed: a request that names its session skips the
history hashing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.record import NO_TOKENS, RequestRecord
from policies.config import SessionsConfig
from policies.sessions import (
    AGENT_HEADER,
    FINAL_HEADER,
    PARENT_HEADERS,
    SESSION_HEADERS,
    SseToolCallScanner,
    answer_tool_call_ids,
    identify,
    redacted,
    turn_facts,
    turn_facts_and_keys,
)
from pools.sessions import Session, SessionStore, Turn


# The headers identify() reads, as ASGI gives them (lower-case bytes): the request's few headers are scanned once
# instead of looking each of these names up in Starlette's Headers (~0.5 µs per missing name).
_HEADER_NAMES = frozenset(name.encode() for name in (*SESSION_HEADERS, AGENT_HEADER, *PARENT_HEADERS, FINAL_HEADER))


def session_headers(raw: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    """The session-related headers of a request, from its raw ASGI headers (the first of each name)."""
    found: dict[str, str] = {}
    for name, value in raw:
        if name in _HEADER_NAMES:
            found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return found


def _conversation_id(session_id: str, raw: bool) -> str:
    """What spans show as gen_ai.conversation.id / session.id: the id itself with `trace_ids: raw`, else its hash."""
    return session_id if raw else redacted(session_id)


class SessionTurn:
    """One request's place in its session, carried on its RequestRecord."""

    __slots__ = ("turn", "source", "register_key", "scanner", "tool_ids", "cache_path", "previous_span", "raw_ids",
                 "_trace_id")
    counted = None  # (prompt, cached) tokens: the metrics parse the usage themselves for a session's turn

    def __init__(self, turn: Turn, source: str, register_key: int | None, scanner: SseToolCallScanner | None,
                 raw_ids: bool) -> None:
        self.turn = turn
        self.source = source  # id_source: header | body | tool_call | history | none
        self.register_key = register_key
        self.scanner = scanner
        self.tool_ids: tuple[str, ...] = ()  # a non-streamed answer's tool calls
        self.cache_path = ""  # warm | cold, once the answer's usage is known
        self.previous_span = turn.session.last_span  # the previous turn's server span, for a span link
        self.raw_ids = raw_ids  # sessions.trace_ids: raw
        self._trace_id: str | None = None

    @property
    def session(self) -> Session:
        return self.turn.session

    @property
    def trace_id(self) -> str:
        """What spans show as gen_ai.conversation.id / session.id: hashed only when a span asks (most requests
        are not sampled)."""
        if self._trace_id is None:
            self._trace_id = _conversation_id(self.turn.session.id, self.raw_ids)
        return self._trace_id


class OneShotTurn:
    """The turn of a request that names no session and continues none: most are one-shots that nothing continues, so
    it gets an id and no Session (`SessionStore.first_turn_id`); its answer is remembered under the keys it leaves
    (`end_first_turn`), and a later turn that brings one back opens the session with this turn in it. Reads like a
    SessionTurn whose `turn` is itself (index 1, no wait)."""

    __slots__ = ("kind", "arrival", "register_key", "scanner", "tool_ids", "cache_path", "counted", "raw_ids",
                 "session_id", "_trace_id")
    index = 1
    wait_kind = ""
    wait_s = 0.0
    final = False
    source = "none"
    previous_span = None

    def __init__(self, session_id: str, kind: str, arrival: float, register_key: int,
                 scanner: SseToolCallScanner | None, raw_ids: bool) -> None:
        self.session_id = session_id
        self.kind = kind
        self.arrival = arrival  # wall clock
        self.register_key = register_key
        self.scanner = scanner
        self.tool_ids: tuple[str, ...] = ()
        self.cache_path = ""
        self.counted: tuple[int, int] | None = None  # (prompt, cached) tokens of its answer, once it ended
        self.raw_ids = raw_ids
        self._trace_id: str | None = None

    @property
    def turn(self) -> OneShotTurn:
        return self

    @property
    def trace_id(self) -> str:
        if self._trace_id is None:
            self._trace_id = _conversation_id(self.session_id, self.raw_ids)
        return self._trace_id


class SessionTracker:
    """The gateway's sessions: a bounded store, shared through Redis when the gateway shares state."""

    def __init__(self, config: SessionsConfig, shared: bool, on_end: Callable[[Session], None] | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.wall = wall
        self.store = SessionStore(max_sessions=config.max_sessions, idle_timeout_s=config.idle_timeout_s,
                                  warm_share=config.warm_share, shared=shared, clock=wall, on_end=on_end)

    def apply_config(self, config: SessionsConfig) -> None:
        """Reload: the limits apply to the store in place (its sessions are kept)."""
        self.config = config
        store = self.store
        store.max_sessions = config.max_sessions
        store.idle_timeout_s = config.idle_timeout_s
        store.warm_share = config.warm_share

    def begin(self, record: RequestRecord, raw_headers: Sequence[tuple[bytes, bytes]], body: dict[str, Any], api: str,
              monotonic_now: float) -> str | None:
        """Put the request in its session and open its turn; returns the session id (sticky routing's key), or None
        for an unnamed first turn (a one-shot as far as anyone knows: nothing to stick to). `raw_headers`: the ASGI
        scope's."""
        store = self.store
        now = self.wall() - (monotonic_now - record.t_arrival)  # its arrival, on the wall clock
        identity = identify(session_headers(raw_headers), body, api, self.config.max_id_chars)
        # only an answer to a request that offered tools can ask for them: other streams are not scanned at all
        scanner = SseToolCallScanner(api) if body.get("stream") is True and body.get("tools") else None
        raw_ids = self.config.trace_ids == "raw"
        if identity.id is None:  # inferred: by the tool results it carries, else by its history
            kind, tool_ids, lookup_key, register_key = turn_facts_and_keys(body, api)
            if not (store.shared or identity.final or identity.parent_id or identity.agent_id
                    or store.continues(tool_ids, lookup_key)):
                record.session = OneShotTurn(store.first_turn_id(now), kind, now, register_key, scanner, raw_ids)
                return None
        else:
            kind, tool_ids = turn_facts(body, api)
            lookup_key = register_key = None
        session, source = store.resolve(identity, tool_ids if identity.id is None else (), lookup_key, now)
        turn = store.begin_turn(session, kind, now)
        session.traffic_class = record.traffic_class or session.traffic_class
        record.session = SessionTurn(turn, source, register_key, scanner, raw_ids)
        return None if session.unopened else session.id

    def answered(self, record: RequestRecord, body: bytes) -> None:
        """A complete (non-streamed) answer: the tool calls it asks for."""
        turn = record.session
        if turn is not None and record.status == 200:
            turn.tool_ids = answer_tool_call_ids(body, record.api)

    def end(self, record: RequestRecord, span: tuple[int, int] | None) -> None:
        """The request is over: close its turn (its answer's last byte, tool calls, usage). `span`: its sampled server
        span (trace id, span id), which the session's next turn links to."""
        turn: SessionTurn | OneShotTurn | None = record.session
        if turn is None:
            return
        last = record.t_last_byte or record.t_first_byte
        last_byte = self.wall() - (time.monotonic() - last) if last else self.wall()
        answered = record.status == 200 and record.error is None and not record.client_disconnected
        tool_ids = (turn.scanner.ids if turn.scanner is not None else turn.tool_ids) if answered else ()
        if type(turn) is OneShotTurn:
            turn.cache_path, prompt, cached = self.store.end_first_turn(
                turn.session_id, turn.kind, turn.arrival, last_byte, tool_ids, turn.register_key if answered else None,
                record.tokens() if answered else NO_TOKENS, record.traffic_class, span)
            turn.counted = prompt, cached
            return
        session = turn.session
        if record.traffic_class:
            session.traffic_class = record.traffic_class
        turn.cache_path = self.store.end_turn(turn.turn, last_byte, tool_ids, turn.register_key if answered else None,
                                              record.tokens() if answered else NO_TOKENS)
        if span is not None:
            session.last_span = span

    def view(self, limit: int = 100) -> dict[str, Any]:
        return self.store.view(limit=limit)
