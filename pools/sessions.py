"""The bounded memory of open agent sessions and their recent answers, so each request can be put in its session and
each turn timed: how long tools took (tool turnaround) and how long a person took (think time) between answers.

A request finds its session first-match-wins (`SessionStore.resolve`): the id it names (policies/sessions.py), else
a tool-call id m3gate returned in an earlier answer, else its history (the previous turn's whole history, hashed),
else a new session with a generated id. Most unnamed first turns are one-shot requests that nothing continues, so
such a session stays *unopened* (outside the LRU, not counted or shown, no end) until a later turn finds it by the
keys its answer left; it then opens with its first turn in it. Without shared state the gateway keeps such a turn
lighter still (`first_turn_id` / `end_first_turn`: an id and, once answered, a tuple under its keys; the Session is
built only when a later turn continues it). Otherwise, per request:

    session, source = store.resolve(identity, tool_result_ids(body, api), lookup_key)
    turn = store.begin_turn(session, turn_kind(body, api))
    ...                                         # route, relay (SseToolCallScanner collects the answer's tool calls)
    store.end_turn(turn, last_byte, scanner.ids, register_key, record.tokens())

Times are wall-clock seconds (`time.time`, injectable): other gateways' answers arrive with their timestamps, and
monotonic clocks differ between processes. Memory is bounded: at most `max_sessions` open sessions (LRU), each with
aggregates and its last `recent_turns` turns packed in one bytes object; at most `max_keys` remembered tool-call ids
and as many history keys (default 2 per session; the newest half always kept); `max_recent` ended sessions for the
admin view; `max_outbox` unpublished events; between max_sessions/2 and max_sessions answered unopened first
turns. 100k sessions take ~105 MiB (`python -m loadtests.bench.sessions`).
Nothing here logs or labels a raw id: `view` hashes them unless asked.

Sharing (pools/shared_state.py): with `shared=True`, each answer's record (session id, turn, tool-call id hashes,
history key, wall-clock times, tokens) waits in an outbox the shared-state flusher drains every 25 ms into the same
Redis stream entry as its dispatches; other gateways `apply_events` it, so a session whose turns alternate between
gateways is one session, with the right turnaround times, on every gateway. A turn that arrives at one gateway before
the previous answer's record (~25-50 ms) can still be placed by an explicit id, and is re-indexed and timed when the
record comes in before its own answer ends; without an explicit id it starts a new session.
"""

from __future__ import annotations

import secrets
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import xxhash

from policies.sessions import ID_SOURCES, TURN_KINDS, SessionIdentity, redacted

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_SESSIONS",
    "WARM_SHARE",
    "Session",
    "SessionStore",
    "SessionStoreCounters",
    "Turn",
    "decode_events",
    "tool_key",
    "wall_clock",
]

DEFAULT_MAX_SESSIONS = 100_000
DEFAULT_IDLE_TIMEOUT_S = 900.0
WARM_SHARE = 0.5
"""A turn is "warm" when at least this share of its prompt tokens were served from the replica's prefix cache
(`usage.prompt_tokens_details.cached_tokens`; Responses `input_tokens_details`; Anthropic `cache_read_input_tokens`):
the session's context was still cached. Below it the replica recomputed most of the prompt ("cold"), e.g. after
the session moved replicas or its blocks were evicted during a long tool call."""

WAIT_KINDS = ("", "tool", "think")
CACHE_PATHS = ("", "warm", "cold")
_KIND = {k: i for i, k in enumerate(TURN_KINDS)}
_SOURCE = {k: i for i, k in enumerate(ID_SOURCES)}
_WAIT = {k: i for i, k in enumerate(WAIT_KINDS)}
_CACHE = {k: i for i, k in enumerate(CACHE_PATHS)}

# One finished turn as kept per session for the admin view: index, kind, wait kind, cache path, arrival offset from
# the session's start, wait, model time, prompt / completion / cached tokens, tool calls asked. 34 bytes.
_TURN = struct.Struct("<IBBBxfffIIIH")
_U32 = 0xFFFFFFFF
K = TypeVar("K")
V = TypeVar("V")


def wall_clock(monotonic_t: float, now_monotonic: float | None = None, now_wall: float | None = None) -> float:
    """The wall-clock time of a `time.monotonic()` reading (RequestRecord's stage times are monotonic; the store's
    are wall clock, to be comparable between gateways)."""
    if now_monotonic is None:
        now_monotonic = time.monotonic()
    if now_wall is None:
        now_wall = time.time()
    return now_wall - (now_monotonic - monotonic_t)


def tool_key(call_id: str) -> int:
    """What is remembered of a tool-call id: its 64-bit hash (smaller than the string, and fixed-size on the wire)."""
    return xxhash.xxh3_64_intdigest(call_id.encode("utf-8", "surrogatepass"))


@dataclass(slots=True, eq=False)
class Session:
    """One agent session: aggregates over all its turns, its last few turns packed (`recent`), and what the next
    turn needs to be timed (the latest answer's end and whether it asked for tools). Wall-clock seconds."""

    id: str
    id_source: str  # how the session was first found: header | body | tool_call | history | none
    started: float  # first arrival
    parent_id: str | None = None
    agent_id: str | None = None
    last_seen: float = 0.0
    last_end: float = 0.0  # last byte of the latest answer (task time = last_end - started)
    turns: int = 0
    in_flight: int = 0
    answer_end: float = 0.0  # last byte of the answer the next turn follows
    answer_turn: int = 0
    answer_tools: bool = False  # that answer asked for tools
    answer_pending: bool = False  # no turn has been timed against that answer yet
    closing: bool = False  # a request said it was the last (x-dynamo-session-final)
    end_reason: str = ""  # final | idle | evicted, once ended
    tool_s: float = 0.0
    tool_waits: int = 0
    think_s: float = 0.0
    think_waits: int = 0
    model_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    warm_turns: int = 0
    cold_turns: int = 0
    recent: bytes = b""  # the last turns, `_TURN` records
    traffic_class: str = ""  # the class of its latest turn (metrics by class; set by the gateway)
    last_span: tuple[int, int] | None = None  # (trace id, span id) of its latest sampled turn, to link the next one
    unopened: bool = False  # an unnamed first turn's: opened (LRU, metrics) only when a later turn continues it


@dataclass(slots=True, eq=False)
class Turn:
    """One request of a session, from arrival to its answer's last byte. `wait_s` is the tool turnaround
    (wait_kind "tool": the previous answer's last byte → this request, which carries its tools' results) or the
    think time ("think": a final answer's last byte → the next user turn); wait_kind "" when there is none."""

    session: Session
    index: int
    kind: str
    arrival: float
    wait_kind: str = ""
    wait_s: float = 0.0
    final: bool = False


@dataclass(slots=True)
class SessionStoreCounters:
    """Monotonic counters for the metrics layer."""

    sessions: int = 0  # sessions opened here (explicit, inferred or generated)
    resolved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ID_SOURCES, 0))  # requests per source
    ended: dict[str, int] = field(default_factory=lambda: {"final": 0, "idle": 0, "evicted": 0})
    events_published: int = 0
    events_dropped: int = 0  # outbox full (Redis away for long)
    events_applied: int = 0


class _RecentKeys(Generic[K, V]):
    """key → value for about the last `capacity` keys put: two generations of plain dicts, the older dropped whole
    when the newer fills half the capacity, so a key is remembered for at least capacity/2 later puts.

    Why not an LRU: popping a plain dict's oldest entry scans the deleted slots before it (quadratic over time), and
    an OrderedDict costs 60% more memory per entry; a key is looked up about once anyway (by the next turn). The
    price: dropping a generation frees it at once, ~1-3 ms of the event loop every capacity/2 answers."""

    __slots__ = ("_half", "_new", "_old")

    def __init__(self, capacity: int) -> None:
        self._half = max(1, capacity // 2)
        self._new: dict[K, V] = {}
        self._old: dict[K, V] = {}

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def get(self, key: K) -> V | None:
        value = self._new.get(key)
        return value if value is not None else self._old.get(key)

    def pop(self, key: K) -> V | None:
        value = self._new.pop(key, None)
        return value if value is not None else self._old.pop(key, None)

    def put(self, key: K, value: V) -> None:
        new = self._new
        new[key] = value
        if len(new) >= self._half:
            self._old, self._new = new, {}


def _charge(session: Session, wait_kind: str, seconds: float, count: int = 1) -> None:
    if wait_kind == "tool":
        session.tool_s += seconds
        session.tool_waits += count
    elif wait_kind == "think":
        session.think_s += seconds
        session.think_waits += count


class SessionStore:
    """Open sessions (LRU, idle timeout), recent answers' tool-call ids and history keys, recently ended sessions.

    Not thread-safe: used from the gateway's event loop only."""

    def __init__(
        self,
        *,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_keys: int | None = None,
        recent_turns: int = 4,
        max_recent: int = 256,
        warm_share: float = WARM_SHARE,
        stuck_turn_s: float = 3600.0,
        shared: bool = False,
        max_outbox: int = 8192,
        clock: Callable[[], float] = time.time,
        id_prefix: str | None = None,
        on_end: Callable[[Session], None] | None = None,
    ) -> None:
        if max_sessions <= 0 or idle_timeout_s <= 0 or recent_turns < 0 or max_recent < 0:
            raise ValueError("max_sessions and idle_timeout_s must be positive, recent_turns and max_recent >= 0")
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.max_keys = max_keys if max_keys is not None else 2 * max_sessions
        self.warm_share = warm_share
        self.stuck_turn_s = stuck_turn_s  # a session with a turn in flight outlives its idle timeout by this much
        self.shared = shared
        self.clock = clock
        self.counters = SessionStoreCounters()
        self._recent_bytes = recent_turns * _TURN.size
        self._open: OrderedDict[str, Session] = OrderedDict()  # least recently active first
        # remembered answers: tool-call id hash / history key → session id
        self._by_tool: _RecentKeys[int, str] = _RecentKeys(self.max_keys)
        self._by_history: _RecentKeys[int, str] = _RecentKeys(self.max_keys)
        # answered unnamed first turns, by id: a Session, or a light first turn's answer (`end_first_turn`)
        self._unopened: _RecentKeys[str, Session | tuple[Any, ...]] = _RecentKeys(max_sessions)
        self._ended: deque[Session] = deque(maxlen=max_recent)
        self._outbox: deque[tuple[Any, ...]] = deque(maxlen=max_outbox)
        self._id_prefix = id_prefix if id_prefix is not None else f"m3s-{secrets.token_hex(4)}-"
        self._next_id = 0
        self.on_end = on_end  # called once per ended session (final, idle, evicted): duration and turn metrics

    def __len__(self) -> int:
        return len(self._open)

    def get(self, session_id: str) -> Session | None:
        """An open session by id (admin API, tests)."""
        return self._open.get(session_id)

    def remembers(self, session_id: str) -> bool:
        """Open, or an answered unnamed first turn that a later turn may still continue."""
        return session_id in self._open or self._unopened.get(session_id) is not None

    # -- resolve -------------------------------------------------------------------------------------------------

    def resolve(self, identity: SessionIdentity, tool_ids: Sequence[str] = (), lookup_key: int | None = None,
                now: float | None = None) -> tuple[Session, str]:
        """The request's session and how it was found (header | body | tool_call | history | none), first match
        wins: the id it names, an earlier answer's tool-call id it carries results for, its history, a new id."""
        if now is None:
            now = self.clock()
        self._expire(now)
        if identity.id is not None:
            source = identity.id_source
            key = identity.id if identity.agent_id is None else f"{identity.id}/{identity.agent_id}"
            parent = identity.parent_id if identity.parent_id is not None or identity.agent_id is None \
                else identity.id  # a sub-agent is a child of the session it works for
            session = self._session(key, source, now, parent, identity.agent_id)
        else:
            session_id, source = self._continued(tool_ids, lookup_key)
            if session_id is None:  # an unnamed first turn: most such requests are one-shots, never continued
                session = Session(self._new_id(), source, now, identity.parent_id, identity.agent_id, last_seen=now,
                                  unopened=True)
            else:
                session = self._session(session_id, source, now, identity.parent_id, identity.agent_id)
        if identity.final:
            session.closing = True
        self.counters.resolved[source] += 1
        return session, source

    # -- unnamed first turns, kept light ----------------------------------------------------------------------------
    # Most requests that name no session and continue none are one-shots that nothing ever continues: they get an id
    # and no Session at all (gateway/sessions.py's OneShotTurn); their answer is remembered as a tuple under its keys,
    # and becomes a Session with that turn in it only when a later turn continues it (`_session`).

    def continues(self, tool_ids: Sequence[str], lookup_key: int | None) -> bool:
        """Whether a remembered answer continues a request carrying these tool results / this history key."""
        return self._continued(tool_ids, lookup_key)[0] is not None

    def first_turn_id(self, now: float) -> str:
        """A new session id for an unnamed first turn that continues nothing (`resolve`'s "none" case, light)."""
        self._expire(now)
        self.counters.resolved["none"] += 1
        return self._new_id()

    def _continued(self, tool_ids: Sequence[str], lookup_key: int | None) -> tuple[str | None, str]:
        """The session whose remembered answer an unnamed request continues, and how it was found: by a tool-call id
        it returned, else by the history key; (None, "none") when nothing continues."""
        by_tool = self._by_tool
        for call_id in tool_ids:
            session_id = by_tool.get(tool_key(call_id))
            if session_id is not None:
                return session_id, "tool_call"
        if lookup_key is not None:
            session_id = self._by_history.get(lookup_key)
            if session_id is not None:
                return session_id, "history"
        return None, "none"

    def _new_id(self) -> str:
        self._next_id += 1
        return f"{self._id_prefix}{self._next_id:x}"

    def cache_path(self, prompt: int, cached: int) -> str:
        """`warm` when vLLM's cached share of the prompt reaches `warm_share`, else `cold`; "" without a prompt count."""
        return "" if prompt <= 0 else "warm" if cached >= self.warm_share * prompt else "cold"

    def end_first_turn(self, session_id: str, kind: str, arrival: float, last_byte: float, tool_call_ids: Iterable[str],
                       register_key: int | None, tokens: tuple[int, int, int], traffic_class: str,
                       span: tuple[int, int] | None) -> tuple[str, int, int]:
        """A light first turn's answer ended: remembered (unopened) when it left keys a later turn may bring back.
        `tokens`: its answer's (prompt, completion, cached prompt) tokens (`usage_counts`). Returns its cache path (as
        `end_turn`) and its prompt and cached tokens."""
        prompt, completion, cached = tokens
        cache = self.cache_path(prompt, cached)
        tool_keys = tuple(map(tool_key, tool_call_ids)) if tool_call_ids else ()
        if tool_keys or register_key is not None:
            self._unopened.put(session_id, (kind, arrival, last_byte, prompt, completion, cached, tool_keys,
                                            register_key, traffic_class, span))
            self._remember_keys(session_id, tool_keys, register_key)
        return cache, prompt, cached

    def _first_turn_session(self, session_id: str, kept: tuple[Any, ...]) -> Session:
        """The unopened Session of a light first turn's remembered answer, with that turn in it."""
        kind, arrival, last_byte, prompt, completion, cached, tool_keys, register_key, traffic_class, span = kept
        session = Session(session_id, "none", arrival, last_seen=arrival, unopened=True, turns=1,
                          traffic_class=traffic_class, last_span=span)
        self._record(session, 1, kind, arrival, "", 0.0, last_byte, prompt, completion, cached, tool_keys,
                     register_key)
        return session

    def _session(self, session_id: str, source: str, now: float, parent: str | None = None,
                 agent: str | None = None) -> Session:
        """The open session `session_id`, or a new one (also when the old one idled out: a new stretch of work)."""
        session = self._open.get(session_id)
        if session is not None:
            if now - session.last_seen <= self.idle_timeout_s or session.in_flight:
                return session
            self._end(session, "idle")
        else:  # an unnamed first turn this turn continues: it becomes an open session now, with that turn in it
            session = self._unopened.pop(session_id)
            if type(session) is tuple:
                session = self._first_turn_session(session_id, session)
            if session is not None and now - session.last_seen <= self.idle_timeout_s:
                session.unopened = False
                self._open[session_id] = session
                self.counters.sessions += 1
                self._evict()
                return session
        session = Session(session_id, source, now, parent, agent, last_seen=now)
        self._open[session_id] = session
        self.counters.sessions += 1
        self._evict()
        return session

    def _evict(self) -> None:
        while len(self._open) > self.max_sessions:
            self._end(self._open.popitem(last=False)[1], "evicted", popped=True)

    # -- turns ---------------------------------------------------------------------------------------------------

    def begin_turn(self, session: Session, kind: str, now: float | None = None) -> Turn:
        """A request of `session` arrived: number it and time the wait since the answer it follows."""
        if now is None:
            now = self.clock()
        session.turns += 1
        session.in_flight += 1
        turn = Turn(session, session.turns, kind, now, final=session.closing)
        self._time_wait(session, turn)
        if now > session.last_seen:
            session.last_seen = now
        if session.end_reason == "":
            self._touch(session)
        return turn

    @staticmethod
    def _time_wait(session: Session, turn: Turn) -> None:
        """Charge the gap since the pending answer to tools (a tool_result turn after an answer that asked for
        tools) or to the person (a user turn). Each answer is charged once, whatever follows it."""
        if not session.answer_pending:
            return
        session.answer_pending = False
        gap = max(0.0, turn.arrival - session.answer_end)
        if turn.kind == "tool_result":
            if session.answer_tools:
                turn.wait_kind, turn.wait_s = "tool", gap
        else:
            turn.wait_kind, turn.wait_s = "think", gap
        _charge(session, turn.wait_kind, gap)

    def end_turn(self, turn: Turn, now_last_byte: float | None = None, tool_call_ids: Iterable[str] = (),
                 register_key: int | None = None, tokens: tuple[int, int, int] = (0, 0, 0)) -> str:
        """The turn's answer ended (its last byte, wall clock): remember its tool calls and history key for the
        next turn, add it to the session's aggregates. `tokens`: its answer's (prompt, completion, cached prompt)
        tokens (`usage_counts`). Returns its cache path: "warm", "cold" or "" (no usage)."""
        last_byte = self.clock() if now_last_byte is None else now_last_byte
        session = turn.session
        if session.in_flight > 0:
            session.in_flight -= 1
        if session.answer_end <= turn.arrival and session.answer_turn >= turn.index:
            # another gateway's answer that ended before this turn arrived was learnt after it began (the sharing
            # lag): this turn follows that answer, so renumber it and time its wait again, against that answer
            turn.index = session.answer_turn + 1
            if turn.index > session.turns:
                session.turns = turn.index
            _charge(session, turn.wait_kind, -turn.wait_s, -1)
            turn.wait_kind, turn.wait_s = "", 0.0
            self._time_wait(session, turn)
        tool_keys = tuple(map(tool_key, tool_call_ids)) if tool_call_ids else ()
        prompt, completion, cached = tokens
        cache = self._record(session, turn.index, turn.kind, turn.arrival, turn.wait_kind, turn.wait_s, last_byte,
                             prompt, completion, cached, tool_keys, register_key)
        if self.shared:
            outbox = self._outbox
            if len(outbox) == outbox.maxlen:
                self.counters.events_dropped += 1
            outbox.append((session, turn.index, turn.kind, turn.arrival, turn.wait_kind, turn.wait_s, last_byte,
                           prompt, completion, cached, tool_keys, register_key, turn.final))
        if turn.final and session.end_reason == "":
            self._end(session, "final")
        elif session.unopened and (tool_keys or register_key is not None):
            self._unopened.put(session.id, session)  # a later turn may find it by these keys
        return cache

    def _record(self, session: Session, index: int, kind: str, arrival: float, wait_kind: str, wait_s: float,
                last_byte: float, prompt: int, completion: int, cached: int, tool_keys: tuple[int, ...],
                register_key: int | None) -> str:
        """One finished answer, local or another gateway's: aggregates, the packed recent turn, remembered keys."""
        model_s = max(0.0, last_byte - arrival)
        session.model_s += model_s
        session.prompt_tokens += prompt
        session.completion_tokens += completion
        session.cached_tokens += cached
        cache = self.cache_path(prompt, cached)
        if cache == "warm":
            session.warm_turns += 1
        elif cache == "cold":
            session.cold_turns += 1
        if last_byte >= session.answer_end:
            session.answer_end = last_byte
            session.answer_turn = index
            session.answer_tools = bool(tool_keys)
            session.answer_pending = True
        if last_byte > session.last_end:
            session.last_end = last_byte
        if last_byte > session.last_seen:
            session.last_seen = last_byte
        if self._recent_bytes:
            packed = _TURN.pack(index & _U32, _KIND.get(kind, 0), _WAIT.get(wait_kind, 0), _CACHE[cache],
                                arrival - session.started, wait_s, model_s, min(prompt, _U32),
                                min(completion, _U32), min(cached, _U32), min(len(tool_keys), 0xFFFF))
            recent = session.recent + packed
            session.recent = recent if len(recent) <= self._recent_bytes else recent[-self._recent_bytes:]
        self._remember_keys(session.id, tool_keys, register_key)
        if session.end_reason == "":
            self._touch(session)
        return cache

    def _remember_keys(self, session_id: str, tool_keys: tuple[int, ...], register_key: int | None) -> None:
        """An answer's keys, for the turn that brings one back: its tool-call ids' hashes and its history key."""
        if tool_keys:
            put = self._by_tool.put
            for key in tool_keys:
                put(key, session_id)
        if register_key is not None:
            self._by_history.put(register_key, session_id)

    # -- ends ----------------------------------------------------------------------------------------------------

    def _touch(self, session: Session) -> None:
        if session.unopened:
            return
        try:
            self._open.move_to_end(session.id)
        except KeyError:  # evicted while its turn was in flight
            pass

    def _end(self, session: Session, reason: str, popped: bool = False) -> None:
        if not popped:
            self._open.pop(session.id, None)
        session.end_reason = reason
        self.counters.ended[reason] += 1
        self._ended.append(session)
        if self.on_end is not None:
            self.on_end(session)

    def _expire(self, now: float, budget: int = 4) -> None:
        """End up to `budget` sessions idle past the timeout (the LRU's head): amortised over requests, so no sweep
        task is needed. A session with a turn in flight is kept (moved back) until `stuck_turn_s` more."""
        opened = self._open
        idle = self.idle_timeout_s
        while opened and budget > 0:
            budget -= 1
            session = next(iter(opened.values()))
            if now - session.last_seen <= idle:
                return
            if session.in_flight and now - session.last_seen <= idle + self.stuck_turn_s:
                opened.move_to_end(session.id)
                continue
            self._end(session, "idle")

    def sweep(self, now: float | None = None) -> int:
        """End every session idle past the timeout (the admin view calls it; requests expire a few each)."""
        before = len(self._open)
        self._expire(self.clock() if now is None else now, budget=before)
        return before - len(self._open)

    # -- admin view ----------------------------------------------------------------------------------------------

    def view(self, now: float | None = None, *, limit: int = 100, raw_ids: bool = False,
             key: bytes | None = None) -> dict[str, list[dict[str, Any]]]:
        """The most recently active open sessions and the recently ended ones (newest first, `limit` each), with
        their last turns' timings. No prompt text; ids hashed (`redacted`, keyed by `key`) unless `raw_ids`."""
        if now is None:
            now = self.clock()
        self.sweep(now)

        def show(value: str | None) -> str | None:
            return value if value is None or raw_ids else redacted(value, key)

        def describe(s: Session) -> dict[str, Any]:
            turns = []
            for i in range(0, len(s.recent), _TURN.size):
                index, kind, wait, cache, offset, wait_s, model_s, prompt, completion, cached, tools = \
                    _TURN.unpack_from(s.recent, i)
                turns.append({"index": index, "kind": TURN_KINDS[kind], "arrival_offset_s": round(offset, 3),
                              "wait": WAIT_KINDS[wait], "wait_s": round(wait_s, 3), "model_s": round(model_s, 3),
                              "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
                              "cache": CACHE_PATHS[cache], "tool_calls": tools})
            return {
                "id": show(s.id), "id_source": s.id_source, "parent_id": show(s.parent_id),
                "agent_id": show(s.agent_id), "state": s.end_reason or "open", "started": s.started,
                "idle_s": round(max(0.0, now - s.last_seen), 3), "turns": s.turns, "in_flight": s.in_flight,
                "task_s": round(max(0.0, s.last_end - s.started), 3), "model_s": round(s.model_s, 3),
                "tool_s": round(s.tool_s, 3), "tool_waits": s.tool_waits,
                "think_s": round(s.think_s, 3), "think_waits": s.think_waits,
                "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                "cached_tokens": s.cached_tokens,
                "cached_share": round(s.cached_tokens / s.prompt_tokens, 3) if s.prompt_tokens else None,
                "warm_turns": s.warm_turns, "cold_turns": s.cold_turns,
                "recent_turns": turns,
            }

        opened = []
        for s in reversed(self._open.values()):
            if len(opened) >= limit:
                break
            opened.append(describe(s))
        ended = [describe(s) for s in list(reversed(self._ended))[:limit]]
        return {"open": opened, "recent": ended}

    # -- sharing between gateways (pools/shared_state.py) --------------------------------------------------------

    def pending_events(self) -> int:
        """Answer records waiting for the shared-state flusher."""
        return len(self._outbox)

    def drain_events(self, limit: int = 1024) -> tuple[bytes, int]:
        """Up to `limit` unpublished answer records, encoded as one batch, and how many: (b"", 0) when none."""
        outbox = self._outbox
        count = min(len(outbox), limit)
        if not count:
            return b"", 0
        records = [bytes((EVENT_WIRE_VERSION,))]
        for _ in range(count):
            records.append(_encode_event(*outbox.popleft()))
        self.counters.events_published += count
        return b"".join(records), count

    def apply_events(self, blob: bytes, now: float | None = None) -> int:
        """Apply another gateway's answer records; raises ValueError / struct.error on a malformed batch (nothing
        is applied then)."""
        events = decode_events(blob)
        if now is None:
            now = self.clock()
        for (session_id, source, parent, agent, index, kind, arrival, wait_kind, wait_s, last_byte, prompt,
             completion, cached, tool_keys, register_key, final) in events:
            if source == "none" and index == 1 and session_id not in self._open and not final:
                # another gateway's unnamed first turn: remembered unopened, like a local one
                session = Session(session_id, source, arrival, parent, agent, last_seen=now, unopened=True)
                session.turns = 1
                self._record(session, index, kind, arrival, wait_kind, wait_s, last_byte, prompt, completion, cached,
                             tool_keys, register_key)
                self._unopened.put(session_id, session)
                continue
            session = self._session(session_id, source, now, parent, agent)
            if arrival < session.started:
                session.started = arrival
            if index > session.turns:
                session.turns = index
            _charge(session, wait_kind, wait_s)
            self._record(session, index, kind, arrival, wait_kind, wait_s, last_byte, prompt, completion, cached,
                         tool_keys, register_key)
            if final and session.end_reason == "":
                self._end(session, "final")
        self.counters.events_applied += len(events)
        return len(events)


# -- wire format of answer records -------------------------------------------------------------------------------
# A batch is a version byte, then per answer a fixed header (flags: bit 0 has a history key, bit 1 final; id source,
# turn kind and wait kind codes; the lengths of session id, parent and agent ids; the number of tool-call hashes;
# turn index; history key; arrival, last byte (wall clock) and wait seconds; prompt, completion, cached tokens),
# then the three UTF-8 ids and the tool-call hashes as little-endian 64-bit integers.

EVENT_WIRE_VERSION = 1
_EVENT = struct.Struct("<BBBBHHHHIQdddIII")
_HAS_KEY, _FINAL = 1, 2
_MAX_STRING = 0xFFFF


def _encode_event(session: Session, index: int, kind: str, arrival: float, wait_kind: str, wait_s: float,
                  last_byte: float, prompt: int, completion: int, cached: int, tool_keys: tuple[int, ...],
                  register_key: int | None, final: bool) -> bytes:
    id_b = session.id.encode("utf-8", "surrogatepass")[:_MAX_STRING]
    parent_b = (session.parent_id or "").encode("utf-8", "surrogatepass")[:_MAX_STRING]
    agent_b = (session.agent_id or "").encode("utf-8", "surrogatepass")[:_MAX_STRING]
    tool_keys = tool_keys[:0xFFFF]
    flags = (_HAS_KEY if register_key is not None else 0) | (_FINAL if final else 0)
    header = _EVENT.pack(flags, _SOURCE.get(session.id_source, 4), _KIND.get(kind, 0), _WAIT.get(wait_kind, 0),
                         len(id_b), len(parent_b), len(agent_b), len(tool_keys), index & _U32, register_key or 0,
                         arrival, last_byte, wait_s, min(prompt, _U32), min(completion, _U32), min(cached, _U32))
    return b"".join((header, id_b, parent_b, agent_b, struct.pack(f"<{len(tool_keys)}Q", *tool_keys)))


_Event = tuple[str, str, "str | None", "str | None", int, str, float, str, float, float, int, int, int,
               tuple[int, ...], "int | None", bool]


def decode_events(blob: bytes) -> list[_Event]:
    """The records of a batch (see the format above); raises ValueError or struct.error if it is malformed."""
    if not blob or blob[0] != EVENT_WIRE_VERSION:
        raise ValueError(f"unknown session event wire version {blob[:1]!r}")
    out: list[_Event] = []
    pos, end, size = 1, len(blob), _EVENT.size
    while pos < end:
        (flags, source, kind, wait_kind, n_id, n_parent, n_agent, n_tools, index, register_key, arrival, last_byte,
         wait_s, prompt, completion, cached) = _EVENT.unpack_from(blob, pos)
        pos += size
        strings_end = pos + n_id + n_parent + n_agent
        tools_end = strings_end + 8 * n_tools
        if tools_end > end or source >= len(ID_SOURCES) or kind >= len(TURN_KINDS) or wait_kind >= len(WAIT_KINDS):
            raise ValueError("truncated or invalid session event")
        session_id = blob[pos:pos + n_id].decode("utf-8", "surrogatepass")
        parent = blob[pos + n_id:pos + n_id + n_parent].decode("utf-8", "surrogatepass") or None
        agent = blob[pos + n_id + n_parent:strings_end].decode("utf-8", "surrogatepass") or None
        tool_keys = struct.unpack_from(f"<{n_tools}Q", blob, strings_end) if n_tools else ()
        out.append((session_id, ID_SOURCES[source], parent, agent, index, TURN_KINDS[kind], arrival,
                    WAIT_KINDS[wait_kind], wait_s, last_byte, prompt, completion, cached, tool_keys,
                    register_key if flags & _HAS_KEY else None, bool(flags & _FINAL)))
        pos = tools_end
    return out
