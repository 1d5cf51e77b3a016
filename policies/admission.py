"""Admission: which request goes upstream now, which waits and in what order, which is refused, and when a
refused client should come back. The pure state behind gateway/admission.py (no I/O; time is passed in).

Each pool has, per traffic class, a limit on requests in flight (`max_concurrency`). A pool is also full when all
its available replicas are saturated (vLLM's own queue is long or its KV cache is full): sending more would only
queue them inside vLLM, first come first served, where a burst of long jobs delays everyone behind it. Waiting in
the gateway instead keeps the order under our control:

- by class priority (lower first), so interactive requests overtake queued repository jobs;
- within a priority level, round-robin between API keys (start-time fair queueing: each key's n-th waiting
  request is tagged n rounds after the current one), so one key's burst cannot starve the others;
- then by arrival.

Refusals carry a Retry-After computed from how fast the pool has been freeing slots (`DrainRate`).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    tag: int = 0


class FairQueue:
    """Waiters ordered by (priority, fair-queueing tag, arrival). Insertion and removal are O(log n + n) on a
    sorted list, which for queues of hundreds costs microseconds and keeps iteration in serving order trivial."""

    __slots__ = ("_order", "_by_seq", "_vtime", "_last_tag", "_per_key", "_per_class", "_next_seq")

    def __init__(self) -> None:
        self._order: list[tuple[int, int, int]] = []
        self._by_seq: dict[int, Waiter] = {}
        self._vtime: dict[int, int] = {}  # per priority level: the tag last served
        self._last_tag: dict[tuple[int, str], int] = {}  # per (level, key): its latest waiter's tag
        self._per_key: Counter[tuple[int, str]] = Counter()
        self._per_class: Counter[str] = Counter()
        self._next_seq = 0

    def push(self, waiter: Waiter) -> None:
        level, key = waiter.priority, (waiter.priority, waiter.fairness_key)
        waiter.seq, self._next_seq = self._next_seq, self._next_seq + 1
        waiter.tag = max(self._vtime.get(level, 0), self._last_tag.get(key, 0)) + 1
        self._last_tag[key] = waiter.tag
        self._per_key[key] += 1
        self._per_class[waiter.cls] += 1
        insort(self._order, (level, waiter.tag, waiter.seq))
        self._by_seq[waiter.seq] = waiter

    def remove(self, waiter: Waiter) -> bool:
        """Take `waiter` out without serving it (it gave up or its client left); False if it was not queued."""
        entry = (waiter.priority, waiter.tag, waiter.seq)
        i = bisect_left(self._order, entry)
        if i == len(self._order) or self._order[i] != entry:
            return False
        del self._order[i]
        del self._by_seq[waiter.seq]
        key = (waiter.priority, waiter.fairness_key)
        self._per_key[key] -= 1
        if not self._per_key[key]:
            del self._per_key[key], self._last_tag[key]
        self._per_class[waiter.cls] -= 1
        if not self._per_class[waiter.cls]:
            del self._per_class[waiter.cls]
        return True

    def serve(self, waiter: Waiter) -> None:
        """Take `waiter` out because it is admitted: the level's round advances to its tag."""
        if self.remove(waiter):
            self._vtime[waiter.priority] = max(self._vtime.get(waiter.priority, 0), waiter.tag)

    def __iter__(self) -> Iterator[Waiter]:
        """In serving order (a copy: the caller may serve or remove while iterating)."""
        return iter([self._by_seq[seq] for _, _, seq in self._order])

    def __len__(self) -> int:
        return len(self._order)

    def queued(self, cls: str) -> int:
        return self._per_class.get(cls, 0)

    def ahead(self, priority: int) -> int:
        """Waiters that would be served before a newcomer of `priority` (all of its level and better ones)."""
        return bisect_left(self._order, (priority + 1, -1, -1))


class DrainRate:
    """Slots freed per second in a pool, over the last DRAIN_WINDOW_S: what Retry-After is computed from."""

    __slots__ = ("_times",)

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=4096)

    def record(self, now: float) -> None:
        self._times.append(now)

    def per_second(self, now: float) -> float | None:
        times = self._times
        while times and times[0] < now - DRAIN_WINDOW_S:
            times.popleft()
        if not times:
            return None
        return len(times) / max(1.0, now - times[0])


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


def pool_saturated(snapshots: Sequence[ReplicaSnapshot], cfg: SaturationConfig) -> bool:
    """Every available replica is saturated. A pool with none available is not 'saturated': pool choice already
    moved past it, or forwarding will say no replica is healthy."""
    any_available = False
    for s in snapshots:  # a loop, not a list and all(): this runs on every admission
        if s.healthy and not s.draining:
            if not replica_saturated(s, cfg):
                return False
            any_available = True
    return any_available


@dataclass
class PoolGate:
    """One pool's admission state in this gateway process: requests in flight per class, the queue, the drain."""

    in_flight: Counter[str] = field(default_factory=Counter)
    queue: FairQueue = field(default_factory=FairQueue)
    drain: DrainRate = field(default_factory=DrainRate)

    def has_room(self, cls: str, limit: int, saturated: bool) -> bool:
        """A newcomer of `cls` may go now: the pool is not saturated, its class has a free slot, and no request of
        its class is already waiting (no overtaking within a class; other classes' waiters are blocked by their
        own limits and do not hold this one back)."""
        return not saturated and self.in_flight.get(cls, 0) < limit and not self.queue.queued(cls)

    def take_slot(self, cls: str) -> None:
        in_flight = self.in_flight
        in_flight[cls] = in_flight.get(cls, 0) + 1  # not `+= 1`: Counter's __missing__ is a Python call

    def free_slot(self, cls: str, now: float) -> None:
        in_flight = self.in_flight
        left = in_flight.get(cls, 0) - 1
        if left > 0:
            in_flight[cls] = left
        else:
            in_flight.pop(cls, None)
        self.drain.record(now)

    def admit_waiting(self, limits: Mapping[str, int], saturated: bool) -> list[Waiter]:
        """Serve waiters in order while their classes have free slots; returns those admitted (slots taken).
        A class no longer configured (removed by a reload) has no limit, so its waiters are let through."""
        if saturated:
            return []
        admitted = []
        for waiter in self.queue:
            limit = limits.get(waiter.cls)
            if limit is None or self.in_flight[waiter.cls] < limit:
                self.queue.serve(waiter)
                self.take_slot(waiter.cls)
                admitted.append(waiter)
        return admitted
