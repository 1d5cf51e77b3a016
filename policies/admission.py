"""Admission: which request goes upstream now, which waits and in what order, which is refused, and when a
refused client should come back. The pure state behind gateway/admission.py (no I/O; time is passed in).

Each pool has, per traffic class, a limit on requests in flight (`max_concurrency`). A pool is also full when all
its available replicas are saturated (vLLM's own queue is long or its KV cache is full): sending more would only
queue them inside vLLM, first come first served, where a burst of long jobs delays everyone behind it. Waiting in
the gateway instead keeps the order under our control:

- by class priority (lower first), so interactive requests overtake queued repository jobs;
- within a priority level, round-robin between API keys (start-time fair queueing: each key's n-th waiting
  request is tagged n rounds after the current one), so one key's burst cannot starve the others;
- within a key's turn, the request of the session with the least attained service (tokens it had prefilled uncached
  and decoded lately, decayed: `ServiceLedger`), for classes with `fairness: session`: one session's burst cannot
  starve the key's other sessions, and a short session is not stuck behind a long one. Waiting earns credit (a
  share, `AGING`, of the tokens the pool served meanwhile), so a session's past service holds its request back by
  at most 1 / AGING times the time the pool took to give it that service: heavy and long sessions wait longer,
  never indefinitely (without it, they held the tail: p99 TTFT twice arrival order's at 250 agent sessions);
- then by arrival.

Refusals carry a Retry-After computed from how fast the pool has been freeing slots (`DrainRate`).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.background import BackgroundWindow, ForegroundLatency
from policies.errors import RequestRejected
from policies.snapshot import ReplicaSnapshot
from policies.config import SaturationConfig

RETRY_AFTER_MAX_S = 120
DRAIN_WINDOW_S = 30.0


class RetryLater(RequestRejected):
    """A refusal that will likely succeed later (429 queue full / rate limited, 503 no capacity / waited too long):
    the gateway answers it with a Retry-After header."""

    def __init__(self, message: str, *, status: int, code: str, retry_after_s: int, type: str = "rate_limit_error",
                 param: str | None = None, queued_s: float = 0.0) -> None:  # noqa: A002 - OpenAI's field name
        super().__init__(message, status=status, type=type, param=param, code=code)
        self.retry_after_s = retry_after_s
        self.queued_s = queued_s  # how long it waited in the queue before this refusal (x-m3gate-queue-ms)


@dataclass(eq=False, slots=True)
class Waiter:
    """One request waiting for a slot in a pool."""

    cls: str
    fairness_key: str  # the API key's id ("" without keys): round-robin happens between these
    priority: int
    arrival: float
    handle: Any = None  # the gateway's wake-up handle (an asyncio future); opaque here
    seq: int = -1
    tag: int = 0  # the key's turn it was last ordered into (`FairQueue.order`)
    session: str = ""  # its session (a request without one is its own): whose attained service it is charged to
    charge: float = 0.0  # the service charged to its session while it runs (its prompt estimate)
    by_session: bool = False  # its class orders by the session's attained service (fairness: session)


AGING = 0.1  # a waiter's credit per second waited: this share of the tokens its pool served meanwhile
SERVICE_HALF_LIFE_S = 60.0  # a session's attained service halves every minute without new service
SERVICE_EXPIRY_S = 10 * SERVICE_HALF_LIFE_S  # a record idle this long (under 0.1% left, nothing running) is dropped
MAX_SERVICE_RECORDS = 65_536  # hard cap: the least recently served records go first


@dataclass(slots=True)
class Service:
    """One session's attained service: tokens prefilled (uncached) and decoded, decayed to `at`; `running`: the
    charges of its requests admitted and not yet ended (not decayed: they are being served now). The decayed
    output tokens and answer count are what a per-session output-length estimate can read."""

    tokens: float = 0.0
    output: float = 0.0
    answers: float = 0.0
    at: float = 0.0
    running: float = 0.0
    in_flight: int = 0
    last_prompt: float = 0.0  # its latest request's prompt tokens: a next turn's growth over it is what misses

    def decay(self, now: float) -> None:
        if now > self.at:
            factor = 0.5 ** ((now - self.at) / SERVICE_HALF_LIFE_S)
            self.tokens *= factor
            self.output *= factor
            self.answers *= factor
            self.at = now


class ServiceLedger:
    """Attained service per session, over a recent window (exponential decay), in bounded memory: records expire
    SERVICE_EXPIRY_S after their last service and at most `max_records` are kept (least recently served evicted)."""

    __slots__ = ("_records", "max_records")

    def __init__(self, max_records: int = MAX_SERVICE_RECORDS) -> None:
        self._records: OrderedDict[str, Service] = OrderedDict()  # least recently served first
        self.max_records = max_records

    def __len__(self) -> int:
        return len(self._records)

    def get(self, session: str) -> Service | None:
        return self._records.get(session)

    def attained(self, session: str, now: float) -> float:
        """Decayed service plus what its running requests were charged; 0 for a session never served."""
        rec = self._records.get(session)
        if rec is None:
            return 0.0
        return rec.running + (rec.tokens * 0.5 ** ((now - rec.at) / SERVICE_HALF_LIFE_S) if now > rec.at else
                              rec.tokens)

    def turn_charge(self, session: str, prompt: float, now: float) -> float:
        """What a new request of `session` is charged while it runs: the tokens it will likely prefill, which for a
        conversation whose earlier turns are cached is its prompt's growth over the session's last one (a whole
        prompt for a new session, or one shorter than the last: another context). Charging whole prompts instead
        pushed every long conversation behind every new one on each turn."""
        if not session:
            return prompt
        rec = self._touch(session, now)
        last, rec.last_prompt = rec.last_prompt, prompt
        return prompt - last if 0 < last <= prompt else prompt

    def admitted(self, session: str, charge: float, now: float) -> None:
        """A request of `session` goes upstream: its `charge` counts until it ends."""
        rec = self._touch(session, now)
        rec.running += charge
        rec.in_flight += 1

    def ended(self, session: str, charge: float, served: float, output: float, now: float) -> None:
        """It ended: its charge is replaced by the service it got (`served` tokens, `output` of them decoded;
        0 when it was never answered)."""
        rec = self._touch(session, now)
        if rec.in_flight:
            rec.in_flight -= 1
            rec.running = max(0.0, rec.running - charge) if rec.in_flight else 0.0
        rec.tokens += served
        if served:
            rec.output += output
            rec.answers += 1

    def _touch(self, session: str, now: float) -> Service:
        records = self._records
        rec = records.get(session)
        if rec is None:
            self.expire(now)
            rec = records[session] = Service(at=now)
        else:
            records.move_to_end(session)
            rec.decay(now)
        return rec

    def expire(self, now: float) -> None:
        """Drop records idle past SERVICE_EXPIRY_S with nothing running, oldest first, and any over the cap."""
        records = self._records
        while len(records) >= self.max_records:
            records.popitem(last=False)
        for _ in range(8):  # a few per call: amortised, never a scan of every record
            if not records:
                return
            session, rec = next(iter(records.items()))
            if now - rec.at < SERVICE_EXPIRY_S:
                return
            if rec.in_flight:  # still running: kept (moved back), decayed
                rec.decay(now)
                records.move_to_end(session)
            else:
                del records[session]


class FairQueue:
    """Waiters ordered by priority level, then round-robin between API keys (start-time fair queueing: each key's
    n-th waiting request holds a turn n rounds after the current one), then, within a key's turn, its waiter of the
    session with the least attained service (classes with `fairness: session`; `ServiceLedger`), then arrival.

    The turns are fixed when requests arrive; which of a key's waiters takes its next turn is decided when the
    queue is read (`order`), since attained service changes while they wait. A lone session (or `fairness: key`)
    therefore gets exactly the order by arrival within its key."""

    __slots__ = ("_turns", "_waiting", "_key_turns", "_vtime", "_per_class", "_next_seq", "ledger", "_now")

    def __init__(self, ledger: ServiceLedger | None = None) -> None:
        self._turns: list[tuple[int, int, int, str]] = []  # (level, tag, seq, key) sorted: the turns' order
        self._waiting: dict[tuple[int, str], list[Waiter]] = {}  # per (level, key): its waiters by arrival
        self._key_turns: dict[tuple[int, str], list[tuple[int, int]]] = {}  # per (level, key): (tag, seq) ascending
        self._vtime: dict[int, int] = {}  # per priority level: the tag last served
        self._per_class: Counter[str] = Counter()
        self._next_seq = 0
        self.ledger = ledger
        self._now = 0.0  # the latest time passed in (`order` with no time reads attained service then)

    def push(self, waiter: Waiter) -> None:
        level, key = waiter.priority, waiter.fairness_key
        lk = (level, key)
        waiter.seq, self._next_seq = self._next_seq, self._next_seq + 1
        tags = self._key_turns.setdefault(lk, [])
        waiter.tag = max(self._vtime.get(level, 0), tags[-1][0] if tags else 0) + 1
        tags.append((waiter.tag, waiter.seq))  # a turn ties with other keys' by when it was taken
        self._waiting.setdefault(lk, []).append(waiter)
        self._per_class[waiter.cls] += 1
        insort(self._turns, (level, waiter.tag, waiter.seq, key))
        self._now = max(self._now, waiter.arrival)

    def remove(self, waiter: Waiter) -> bool:
        """Take `waiter` out without serving it (it gave up or its client left); False if it was not queued. Its
        key gives up its last turn: the key's other waiters keep their places."""
        lk = (waiter.priority, waiter.fairness_key)
        if not self._take(waiter):
            return False
        self._drop_turn(lk, len(self._key_turns[lk]) - 1)
        return True

    def serve(self, waiter: Waiter) -> None:
        """Take `waiter` out because it is admitted, in the turn `order` gave it: the level's round advances."""
        lk = (waiter.priority, waiter.fairness_key)
        if not self._take(waiter):
            return
        tags = self._key_turns[lk]
        i = bisect_left(tags, (waiter.tag, -1))
        i = i if i < len(tags) and tags[i][0] == waiter.tag else 0  # not ordered since it came: its key's first turn
        tag = tags[i][0]
        self._drop_turn(lk, i)
        self._vtime[waiter.priority] = max(self._vtime.get(waiter.priority, 0), tag)

    def _take(self, waiter: Waiter) -> bool:
        waiters = self._waiting.get((waiter.priority, waiter.fairness_key))
        if not waiters or waiter not in waiters:
            return False
        waiters.remove(waiter)
        self._per_class[waiter.cls] -= 1
        if not self._per_class[waiter.cls]:
            del self._per_class[waiter.cls]
        return True

    def _drop_turn(self, lk: tuple[int, str], i: int) -> None:
        tags = self._key_turns[lk]
        tag, seq = tags.pop(i)
        turns = self._turns
        del turns[bisect_left(turns, (lk[0], tag, seq, lk[1]))]
        if not tags:
            del self._key_turns[lk], self._waiting[lk]

    def order(self, now: float | None = None, served_per_s: float = 0.0) -> list[Waiter]:
        """Every waiter in serving order (a copy: the caller may serve or remove while iterating); each one's
        `tag` is set to the turn it takes. `now`: when attained service is read (default: the latest time seen);
        `served_per_s`: the pool's recent service rate in tokens, a waiter's credit per second waited (`AGING`)."""
        if now is not None:
            self._now = max(self._now, now)
        ledger, at = self.ledger, self._now
        credit = AGING * served_per_s
        picks: dict[tuple[int, str], Iterator[Waiter]] = {}
        for lk, waiters in self._waiting.items():
            if ledger is not None and len(waiters) > 1 and any(w.by_session for w in waiters):
                service: dict[str, float] = {}
                for w in waiters:
                    if w.by_session and w.session not in service:
                        service[w.session] = ledger.attained(w.session, at)
                ranked = sorted(waiters, key=lambda w: (
                    service.get(w.session, 0.0) - credit * (at - w.arrival) if w.by_session else 0.0, w.seq))
                picks[lk] = iter(ranked)
            else:
                picks[lk] = iter(waiters)
        out = []
        for level, tag, _, key in self._turns:
            waiter = next(picks[(level, key)])
            waiter.tag = tag
            out.append(waiter)
        return out

    def __iter__(self) -> Iterator[Waiter]:
        return iter(self.order())

    def __len__(self) -> int:
        return len(self._turns)

    def queued(self, cls: str) -> int:
        return self._per_class.get(cls, 0)

    def classes(self) -> Iterator[str]:
        """The classes with a request waiting."""
        return iter(self._per_class)

    def ahead(self, priority: int) -> int:
        """Waiters that would be served before a newcomer of `priority` (all of its level and better ones)."""
        return bisect_left(self._turns, (priority + 1, -1, -1, ""))


class DrainRate:
    """Slots freed per second in a pool, over the last DRAIN_WINDOW_S (what Retry-After is computed from), and the
    tokens the requests that freed them were served (what a waiter's fairness credit is computed from)."""

    __slots__ = ("_times", "_tokens")

    def __init__(self) -> None:
        self._times: deque[tuple[float, float]] = deque(maxlen=4096)
        self._tokens = 0.0  # the sum over _times

    def record(self, now: float, tokens: float = 0.0) -> None:
        times = self._times
        if len(times) == times.maxlen:
            self._tokens -= times[0][1]
        times.append((now, tokens))
        self._tokens += tokens

    def _trim(self, now: float) -> None:
        times = self._times
        while times and times[0][0] < now - DRAIN_WINDOW_S:
            self._tokens -= times.popleft()[1]
        if not times:
            self._tokens = 0.0  # no float drift left behind

    def per_second(self, now: float) -> float | None:
        self._trim(now)
        times = self._times
        if not times:
            return None
        return len(times) / max(1.0, now - times[0][0])

    def tokens_per_second(self, now: float) -> float:
        """Tokens served per second by the requests that ended in the window (0 when none did)."""
        self._trim(now)
        times = self._times
        return self._tokens / max(1.0, now - times[0][0]) if times else 0.0


def retry_after_s(waiting_ahead: int, rate: float | None, fallback_s: float) -> int:
    """Whole seconds until the `waiting_ahead` requests in front (and this one) would have drained at `rate`;
    `fallback_s` when nothing drained recently. Always 1..RETRY_AFTER_MAX_S."""
    seconds = (waiting_ahead + 1) / rate if rate else fallback_s
    return int(min(RETRY_AFTER_MAX_S, max(1, math.ceil(seconds))))


def replica_saturated(snapshot: ReplicaSnapshot, cfg: SaturationConfig) -> bool:
    """Fresh metrics say vLLM's own queue is long or its KV cache is full. Stale or missing metrics say nothing
    (the class limits still bound the load)."""
    if snapshot.metrics_age_s is None or snapshot.metrics_age_s > cfg.stale_after_s:
        return False
    if cfg.max_waiting is not None and snapshot.waiting is not None and snapshot.waiting >= cfg.max_waiting:
        return True
    return cfg.max_kv_usage is not None and snapshot.kv_usage is not None and snapshot.kv_usage >= cfg.max_kv_usage


def pool_saturated(snapshots: Iterable[ReplicaSnapshot], cfg: SaturationConfig) -> bool:
    """Every available replica is saturated. A pool with none available is not 'saturated': pool choice already
    moved past it, or forwarding will say no replica is healthy. Reads `snapshots` in order and stops at the first
    available replica that is not saturated (a generator is built no further)."""
    any_available = False
    for s in snapshots:  # a loop, not a list and all(): this runs on every admission
        if s.healthy and not s.draining:
            if not replica_saturated(s, cfg):
                return False
            any_available = True
    return any_available


def pool_pressure(snapshots: Sequence[ReplicaSnapshot], cfg: SaturationConfig) -> bool:
    """Some available replica of the pool is saturated: the background lane backs off (`pool_saturated`, every
    one of them, is when foreground admission waits)."""
    return any(s.healthy and not s.draining and replica_saturated(s, cfg) for s in snapshots)


@dataclass
class PoolGate:
    """One pool's admission state in this gateway process: requests in flight per class, the queue, the drain."""

    in_flight: Counter[str] = field(default_factory=Counter)
    queue: FairQueue = field(default_factory=FairQueue)
    drain: DrainRate = field(default_factory=DrainRate)
    windows: dict[str, BackgroundWindow] = field(default_factory=dict)  # per background class (policies/background.py)
    latency: ForegroundLatency = field(default_factory=ForegroundLatency)  # the foreground's recent TTFT here

    @classmethod
    def with_ledger(cls, ledger: ServiceLedger) -> PoolGate:
        """A gate whose queue orders sessions by the attained service `ledger` keeps (shared by all pools)."""
        return cls(queue=FairQueue(ledger))

    def has_room(self, cls: str, limit: int, saturated: bool) -> bool:
        """A newcomer of `cls` may go now: the pool is not saturated, its class has a free slot, and no request of
        its class is already waiting (no overtaking within a class; other classes' waiters are blocked by their
        own limits and do not hold this one back)."""
        return not saturated and self.in_flight.get(cls, 0) < limit and not self.queue.queued(cls)

    def window(self, cls: str, ceiling: int) -> BackgroundWindow:
        """Background class `cls`'s window in this pool, made on first use (`ceiling`: its max_concurrency)."""
        window = self.windows.get(cls)
        if window is None:
            window = self.windows[cls] = BackgroundWindow(ceiling=ceiling)
        return window

    def _room_for_any(self, limits: Mapping[str, int]) -> bool:
        in_flight = self.in_flight
        for cls in self.queue.classes():
            limit = limits.get(cls)
            if limit is None or in_flight.get(cls, 0) < limit:
                return True
        return False

    def take_slot(self, cls: str) -> None:
        in_flight = self.in_flight
        in_flight[cls] = in_flight.get(cls, 0) + 1  # not `+= 1`: Counter's __missing__ is a Python call

    def free_slot(self, cls: str, now: float, served: float = 0.0) -> None:
        in_flight = self.in_flight
        left = in_flight.get(cls, 0) - 1
        if left > 0:
            in_flight[cls] = left
        else:
            in_flight.pop(cls, None)
        self.drain.record(now, served)

    def admit_waiting(self, limits: Mapping[str, int], saturated: bool, now: float | None = None) -> list[Waiter]:
        """Serve waiters in order (attained service read at `now`) while their classes have free slots; returns
        those admitted (slots taken). A class no longer configured (removed by a reload) has no limit, so its
        waiters are let through."""
        if saturated or not self._room_for_any(limits):
            return []  # nobody can go: the queue is not even ordered (most pumps, while every class is full)
        admitted = []
        rate = self.drain.tokens_per_second(now) if now is not None else 0.0
        for waiter in self.queue.order(now, rate):
            limit = limits.get(waiter.cls)
            if limit is None or self.in_flight[waiter.cls] < limit:
                self.queue.serve(waiter)
                self.take_slot(waiter.cls)
                admitted.append(waiter)
        return admitted
