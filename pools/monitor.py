"""Active health checks and /metrics scraping for every replica, each on its own schedule (policies/probing.py).

A replica with load is scraped every `server.health_interval_s`; an idle one backs off to 16× that and snaps back
when a request is dispatched to it. Every visit probes /health, then scrapes; a real request that fails brings the
visit forward (at most once per interval). One task sleeps
until the next replica is due; each visit runs as its own short task, so one slow replica delays no other.

A replica is healthy when `/health` answers 200; a 503 there (vLLM's engine dead or going) also drains it. A probe
that times out is ambiguous (the replica may hang, or this gateway's own event loop may lag on a busy machine, which
would fail every probe at once and leave the pool with no replica): a healthy replica is marked unhealthy after
`TIMEOUTS_TO_UNHEALTHY` timed-out probes in a row; an answer other than 200 or a refused connection marks it at once.
A replica draining because it is shutting down (pools/replicas.py `shutting_down`) leaves that state only when a
probe shows it takes requests again: vLLM keeps answering /health 200 all through its shutdown, so health alone
cannot tell.

A replica's load (waiting, running, KV usage, prefix counters, cache config) comes from vLLM's own `/metrics`. The
scrape asks for just the series routing reads (`?name[]=...`, which vLLM's prometheus_client exposition honours: a
few hundred bytes instead of tens of KB), and only those lines are read (a server that ignores the filter costs more
bytes, not a wrong answer).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import re
import time
import zlib
from collections.abc import Callable, Iterable
from urllib.parse import quote

import aiohttp

from policies.probing import ProbeState, ProbingPolicy, Visit
from policies.vllm_wire import health_says_draining
from pools.replica_tokenize import post_tokenize
from pools.replicas import Replica, ScrapedLoad
from pools.tasks import cancel_and_wait

log = logging.getLogger("m3gate.monitor")

# A request that exercises what a shutting-down vLLM refuses (its renderer) and nothing of its engine.
_PROBE = b'{"prompt":"m3gate drain probe"}'
TIMEOUTS_TO_UNHEALTHY = 2  # timed-out /health probes in a row before a healthy replica counts as unhealthy

# The sample names routing reads: asked for by name (prometheus_client filters on sample names, so a counter's
# `_total`), and the lines kept from the answer.
WANTED_SAMPLES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:cache_config_info",
)
METRICS_PATH = "/metrics?" + "&".join(f"name%5B%5D={quote(name)}" for name in WANTED_SAMPLES)
_WANTED = tuple(name.encode() + b"{" for name in WANTED_SAMPLES)


_CACHE_LABELS = re.compile(rb'[{,]\s*(num_gpu_blocks|block_size)="(\d+)"')


def parse_vllm_metrics(text: bytes) -> ScrapedLoad:
    """Sum the routing-relevant series over engines (DP ranks) from a vLLM /metrics body. Its lines are
    `name{labels} value [timestamp]`: the value is read after the labels' closing brace and only cache_config_info's
    two labels are read, so a scrape costs tens of µs (prometheus_client's parser took a millisecond, most of it
    on labels). A malformed wanted line raises ValueError."""
    values: dict[bytes, float] = {}
    engines = 0
    blocks: int | None = None
    block_size: int | None = None
    for line in text.split(b"\n"):
        if not line.startswith(_WANTED):
            continue
        brace, close = line.find(b"{"), line.rfind(b"}")
        if close < brace:
            raise ValueError(f"malformed sample line {line[:200]!r}")
        name = line[:brace]
        if name == b"vllm:cache_config_info":
            for key, digits in _CACHE_LABELS.findall(line, brace, close + 1):
                if key == b"num_gpu_blocks":
                    blocks = (blocks or 0) + int(digits)
                else:
                    block_size = int(digits)
            continue
        fields = line[close + 1:].split()
        if not fields:
            raise ValueError(f"no value in {line[:200]!r}")
        values[name] = values.get(name, 0.0) + float(fields[0])
        engines += name == b"vllm:kv_cache_usage_perc"
    return ScrapedLoad(
        waiting=values.get(b"vllm:num_requests_waiting", 0.0),
        running=values.get(b"vllm:num_requests_running", 0.0),
        kv_usage=values.get(b"vllm:kv_cache_usage_perc", 0.0) / max(1, engines),
        prefix_queries=values.get(b"vllm:prefix_cache_queries_total", 0.0),
        prefix_hits=values.get(b"vllm:prefix_cache_hits_total", 0.0),
        num_gpu_blocks=blocks,
        block_size=block_size,
    )


class _Tracked:
    """A replica the monitor probes: its schedule, its timed-out probes in a row, whether a visit is under way."""

    __slots__ = ("replica", "state", "timeouts", "visiting")

    def __init__(self, replica: Replica, state: ProbeState) -> None:
        self.replica = replica
        self.state = state
        self.timeouts = 0
        self.visiting = False


class ReplicaMonitor:
    """Probes the replicas `replicas()` returns, each when policies/probing.py says it is due; one task sleeps until
    the next one is. `replicas_changed()` (config reload, discovery) has it look at the set again; it also does once
    per longest backed-off period."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        replicas: Callable[[], Iterable[Replica]],
        interval_s: float,
        headers_for: Callable[[Replica], dict[str, str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_capacity: Callable[[], None] | None = None,
    ) -> None:
        self._on_capacity = on_capacity
        self._session = session
        self._replicas = replicas
        self._policy = ProbingPolicy(interval_s)
        self._headers_for = headers_for or (lambda _r: {})
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(total=max(0.5, min(2.0, interval_s)))
        self._tracked: dict[int, _Tracked] = {}  # id(replica) → its schedule
        self._due: list[tuple[float, int, int]] = []  # (next visit, tiebreak, id(replica)); stale entries skipped
        self._seq = itertools.count()
        self._synced_at = -float("inf")
        self._task: asyncio.Task[None] | None = None
        self._visits: set[asyncio.Task[None]] = set()
        self._wakeup: asyncio.Future[None] | None = None
        self._sleeps_until = float("inf")  # while the loop sleeps: when it wakes

    @property
    def policy(self) -> ProbingPolicy:
        return self._policy

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="m3gate-replica-monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        for visit in list(self._visits):
            await cancel_and_wait(visit)
        for tracked in self._tracked.values():
            tracked.replica.probe_wake = None
            tracked.replica.probe_backed_off = False

    def replicas_changed(self) -> None:
        """The replica set may have changed: look at it before the next visit."""
        self._synced_at = -float("inf")
        self._wake()

    def state_of(self, replica: Replica) -> ProbeState | None:
        tracked = self._tracked.get(id(replica))
        return tracked.state if tracked is not None else None

    async def poll_once(self) -> None:
        """Visit every replica now, /health included (at start, and in tests)."""
        self._sync(self._clock())
        tracked = [t for t in self._tracked.values() if not t.visiting]
        if tracked:
            await asyncio.gather(*(self._visit(t) for t in tracked), return_exceptions=True)

    # scheduling ----------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = self._clock()
            try:
                if now - self._synced_at >= self._policy.max_period_s:
                    self._sync(now)
                self._start_due(now)
            except Exception:  # noqa: BLE001 - a bad reading of the replica set must not end the probing
                log.exception("replica monitor: scheduling failed")
                self._synced_at = now
            until = min(self._due[0][0] if self._due else now + self._policy.interval_s,
                        self._synced_at + self._policy.max_period_s)
            self._wakeup = wakeup = loop.create_future()
            self._sleeps_until = until
            timer = loop.call_later(max(0.0, until - self._clock()), _resolve, wakeup)
            try:
                await wakeup
            finally:
                timer.cancel()
                self._wakeup, self._sleeps_until = None, float("inf")

    def _wake(self) -> None:
        if self._wakeup is not None:
            _resolve(self._wakeup)

    def _sync(self, now: float) -> None:
        """Track new replicas (due at once), forget gone ones."""
        self._synced_at = now
        current = {id(r): r for r in self._replicas()}
        for key in [k for k in self._tracked if k not in current]:
            gone = self._tracked.pop(key).replica
            gone.probe_wake, gone.probe_backed_off = None, False
        for key, replica in current.items():
            if key not in self._tracked:
                phase = zlib.crc32(replica.url.encode()) / 2**32
                tracked = self._tracked[key] = _Tracked(replica, self._policy.new(now, phase))
                replica.probe_wake = self._replica_event
                self._push(key, tracked.state.next_at)

    def _push(self, key: int, at: float) -> None:
        """Schedule a visit; the loop wakes if it sleeps past it."""
        heapq.heappush(self._due, (at, next(self._seq), key))
        if at < self._sleeps_until:
            self._wake()

    def _start_due(self, now: float) -> None:
        """Start a visit of each replica due by `now` (an entry whose replica is gone, being visited or rescheduled
        since is dropped)."""
        due = self._due
        while due and due[0][0] <= now:
            at, _, key = heapq.heappop(due)
            tracked = self._tracked.get(key)
            if tracked is None or tracked.visiting or tracked.state.next_at != at:
                continue
            visit = asyncio.get_running_loop().create_task(self._visit(tracked))
            self._visits.add(visit)
            visit.add_done_callback(self._visit_done)

    def _visit_done(self, visit: asyncio.Task[None]) -> None:
        self._visits.discard(visit)
        if not visit.cancelled() and visit.exception() is not None:
            log.error("replica monitor: a visit failed", exc_info=visit.exception())

    def _replica_event(self, replica: Replica, failed: bool) -> None:
        """From the request path (`Replica.probe_wake`): a dispatch to a backed-off replica, or a failed request /
        a drain: its next visit moves earlier."""
        key = id(replica)
        tracked = self._tracked.get(key)
        if tracked is None:
            return
        state, now = tracked.state, self._clock()
        moved = self._policy.failed(state, now) if failed else self._policy.dispatched(state, now)
        replica.probe_backed_off = False
        if moved and not tracked.visiting:
            self._push(key, state.next_at)

    # one visit -----------------------------------------------------------------------------------------------
    async def _visit(self, tracked: _Tracked) -> None:
        replica, state, policy = tracked.replica, tracked.state, self._policy
        tracked.visiting = True
        scraped = False
        try:
            headers = self._headers_for(replica)
            if await self._probe_health(tracked, headers):
                scraped = await self._scrape(replica, headers)
        finally:
            tracked.visiting = False
            load = replica.scraped
            policy.visited(state, self._clock(), Visit(
                healthy=replica.healthy, shutting_down=replica.shutting_down is not None,
                in_flight=replica.in_flight, dispatches=replica.requests_total,
                engine_load=(load.running + load.waiting) if load is not None else 0.0, scraped=scraped))
            replica.probe_backed_off = policy.backed_off(state)
            if self._tracked.get(id(replica)) is tracked:
                self._push(id(replica), state.next_at)

    async def _probe_health(self, tracked: _Tracked, headers: dict[str, str]) -> bool:
        """/health, applied to the replica; then, for one shutting down, whether it takes requests again. True when
        it may be scraped."""
        replica = tracked.replica
        healthy = await self._health(tracked, headers)
        if healthy is None:
            self._policy.health_failed(tracked.state)
            return False  # one timed-out probe: keep the replica as it is, probe it again next time
        if healthy != replica.healthy:
            log.warning("replica %s (pool %s) is now %s", replica.url, replica.pool, "healthy" if healthy else "UNHEALTHY")
        replica.healthy = healthy
        self._policy.health_answered(tracked.state, healthy)
        if not healthy:
            return False
        return replica.shutting_down is None or await self._takes_requests(replica, headers)

    async def _takes_requests(self, replica: Replica, headers: dict[str, str]) -> bool:
        """Whether a replica that was shutting down takes requests again (a new process at its URL): a /tokenize,
        which vLLM refuses as it refuses a generate request while it shuts down, answered with anything but that
        refusal or a 5xx. Then it is back in rotation."""
        answer = await post_tokenize(self._session, replica.url, _PROBE, headers, self._timeout.total or 2.0)
        if not answer.status:
            if not answer.refused:
                log.debug("drain probe of %s failed: %r", replica.url, answer.error)
            return False
        if answer.shutting_down or answer.status >= 500:
            return False
        replica.stop_draining()
        return True

    async def _health(self, tracked: _Tracked, headers: dict[str, str]) -> bool | None:
        """Whether /health says the replica serves; None for a timeout that does not yet count (see the module)."""
        replica = tracked.replica
        try:
            async with self._session.get(replica.url + "/health", headers=headers, timeout=self._timeout) as resp:
                await resp.read()
                if health_says_draining(resp.status):
                    replica.start_draining("/health answered 503")
                tracked.timeouts = 0
                return resp.status == 200
        except asyncio.TimeoutError:
            tracked.timeouts += 1
            return None if replica.healthy and tracked.timeouts < TIMEOUTS_TO_UNHEALTHY else False
        except (aiohttp.ClientError, OSError):
            tracked.timeouts = 0
            return False

    async def _scrape(self, replica: Replica, headers: dict[str, str]) -> bool:
        """/metrics, just the series routing reads; True when it answered 200 with a body that parses."""
        try:
            async with self._session.get(replica.url + METRICS_PATH, headers=headers, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return False
                body = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False
        try:
            load = parse_vllm_metrics(body)
        except ValueError:
            return False
        replica.scraped = load
        replica.scraped_at = self._clock()
        if load.waiting > 0 and load.running > replica.batch_full_at:
            replica.batch_full_at = load.running
        if load.num_gpu_blocks and replica.kv_blocks is None:
            replica.kv_blocks = load.num_gpu_blocks  # learnt once; the prefix index is re-bounded to it
            if self._on_capacity is not None:
                self._on_capacity()
        return True


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
