"""Traffic control on the request path: API keys, input limits, traffic classes, rate limits and admission, behind
one object (`TrafficControl`) that the gateway calls a few times per request:

    client = traffic.authenticate(request)              # 431 / 401, before the body is read
    async with traffic.body_deadline(): read the body    # 408 for a body that never arrives
    traffic.check_input(body, api)                       # too many messages or images, oversized inline images
    admitted = await traffic.admit(...)                  # 403 / 429 / 503, or a slot (maybe after waiting)
    ... forward ...; traffic.finished(record)            # frees the slot when the upstream request has ended

Admission itself (`AdmissionControl`) turns policies/admission.py's pure state into waiting: a queued request awaits
a future that a freed slot resolves, while watching its client; a client that leaves is taken out of the queue at
once, and a request that waited `max_queue_wait_s` is refused with 503. Slots are per process (the class limits are
per gateway process; rate limits are the part shared across processes).

Background classes (policies/background.py) go only into headroom, within a window per pool; while a foreground
request waits on a saturated pool, the pool's background streams are paused (their Resumer ends the upstream request
and `paused` holds them until the lane has room; docs/scheduling.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from starlette.requests import Request
from starlette.types import Receive

from gateway.access import (
    IN_PROCESS_CLIENT,
    OPEN_GATEWAY_WARNING,
    Client,
    KeyStore,
    body_deadline,
    check_header_size,
)
from gateway.errors import QUEUE_MS_HEADER, queue_ms
from gateway.record import RequestRecord
from policies.admission import PoolGate, RetryLater, ServiceLedger, Waiter, retry_after_s
from policies.background import BackgroundWindow, has_headroom, lane_limits
from policies.classify import RequestProfile
from policies.errors import RequestRejected
from policies.pool_choice import PoolChoice
from policies.traffic import CLASS_HEADER, check_input_limits, request_priority, resolve_class, restrict_to_key
from policies.config import GatewayConfig, TrafficClassConfig, TrafficConfig
from pools.rate_limit import RateLimiter, openai_duration, rate_limit_headers
from pools.tasks import cancel_and_wait

log = logging.getLogger("m3gate.admission")

TICK_S = 0.05  # how often queued requests are re-checked while replicas are saturated (metrics change, no event)
MADE_ROOM_GRACE_S = 1.0  # after a pause for a foreground arrival, vLLM's queue shows it this long without a cut
_TTFT_SAMPLES = 1024


class ClientGone(Exception):
    """The client disconnected while its request waited for a slot."""


class Pausable(Protocol):
    """A background stream the lane may pause (gateway/migration/'s Resumer): `pause` ends its upstream request and
    holds its client until `AdmissionControl.paused` lets it go on."""

    pauses: int

    @property
    def replica(self) -> str | None:
        """The replica its current leg runs on."""

    def pause(self) -> bool: ...


class Ticket:
    """A held admission slot, released exactly once however the upstream request ends (idempotent, like the
    replica's LoadGuard; `__del__` is only the last line of defence). A paused background stream's ticket holds no
    slot (`holds_slot`) until the lane lets it go on."""

    __slots__ = ("_owner", "pool", "cls", "queued_s", "session", "charge", "holds_slot", "stream")

    def __init__(self, owner: AdmissionControl, pool: str, cls: str, session: str = "", charge: float = 0.0) -> None:
        self._owner: AdmissionControl | None = owner
        self.pool = pool
        self.cls = cls
        self.queued_s = 0.0  # how long its request waited in the queue for it (x-m3gate-queue-ms)
        self.session = session  # whose attained service its request counts in ("": none tracked)
        self.charge = charge
        self.holds_slot = True
        self.stream: Pausable | None = None  # a background stream the lane may pause

    def release(self, served: float = 0.0, output: float = 0.0) -> None:
        """`served`: tokens its request had prefilled (uncached) and decoded, `output` of them decoded."""
        owner, self._owner = self._owner, None
        if owner is not None:
            if self.stream is not None:
                owner.forget(self)
            if self.holds_slot:
                owner.release(self.pool, self.cls, served)
            if self.session:
                owner.ledger.ended(self.session, self.charge, served, output, owner.clock())

    def __del__(self) -> None:
        self.release()


class AdmissionControl:
    """Per-pool slots, queues and spill for this gateway process."""

    def __init__(self, traffic: TrafficConfig, clock: Callable[[], float], saturated: Callable[[str], bool],
                 pressure: Callable[[str], bool] | None = None, batches_full: Callable[[str], bool] | None = None
                 ) -> None:
        self.clock = clock
        self.saturated = saturated
        self.pressure = pressure or saturated  # some replica of the pool is saturated: the background lane's signal
        self.batches_full = batches_full or (lambda pool: False)  # no batch slot free: the lane waits, uncut
        self._made_room_at: dict[str, float] = {}  # per pool: the latest pause for a foreground arrival
        self.gates: dict[str, PoolGate] = {}
        self._streams: dict[str, set[Ticket]] = {}  # per pool: its background streams that can be paused
        self._paused: dict[str, deque[tuple[Ticket, asyncio.Future[None]]]] = {}  # per pool: paused, oldest first
        self.ledger = ServiceLedger()  # attained service per session, across this process's pools
        self.counters: Counter[str] = Counter()
        self._floors: dict[str, int] = {}  # background class → its window floor (batch deadlines)
        self._wake = asyncio.Event()
        self._ticker: asyncio.Task[None] | None = None
        self.apply_config(traffic)

    def apply_config(self, traffic: TrafficConfig) -> None:
        """New limits apply at once: a raised limit lets waiters in at the next pump."""
        self.traffic = traffic
        self._limits = {name: c.max_concurrency for name, c in traffic.classes.items()}
        self.background = traffic.background_classes()
        for gate in self.gates.values():
            for cls in list(gate.windows):
                if cls in self.background:
                    gate.windows[cls].resize(self._limits[cls])
                else:
                    del gate.windows[cls]
        self._wake.set()

    def start(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick(), name="m3gate-admission")

    async def stop(self) -> None:
        if self._ticker is not None:
            await cancel_and_wait(self._ticker)
            self._ticker = None
        for gate in self.gates.values():
            for waiter in gate.queue:
                gate.queue.remove(waiter)
                if not waiter.handle.done():
                    waiter.handle.set_exception(RetryLater(
                        "The gateway is shutting down; retry the request (another gateway will take it).",
                        status=503, type="server_error", code="shutting_down", retry_after_s=1))

    # request path --------------------------------------------------------------------------------------------
    async def admit(self, receive: Receive, pools: Sequence[str], cls: str, priority: int, fairness_key: str,
                    session: str = "", charge: float = 0.0) -> tuple[str, Ticket]:
        """A slot in `pools[0]`, or in a later pool with headroom (spill), or after waiting in `pools[0]`'s queue.
        `session`: whose attained service the request is charged to (`charge` while it runs) and, with the class's
        `fairness: session`, ordered by. Raises RetryLater (429 queue full, 503 waited too long / no queue) or
        ClientGone."""
        cfg = self.traffic.classes.get(cls)
        if cfg is None:  # a reload removed the class while this request was being classified
            raise RetryLater(f"Traffic class '{cls}' was just removed from the configuration; retry the request.",
                             status=503, type="server_error", code="traffic_class_removed", retry_after_s=1)
        home = pools[0]
        gate = self._gate(home)
        if len(gate.queue):
            self._pump(home)  # whoever is already waiting goes first
        if gate.has_room(cls, self._limit(gate, home, cls), self.saturated(home)):
            return home, self._grant(gate, home, cls, session, charge)
        if cfg.spill_upward:
            for name in pools[1:]:
                other = self._gate(name)
                if not len(other.queue) and other.has_room(cls, self._limit(other, name, cls), self.saturated(name)):
                    self.counters["spilled"] += 1
                    return name, self._grant(other, name, cls, session, charge)
        if gate.queue.queued(cls) >= cfg.queue_length:
            self.counters["rejected_queue_full"] += 1
            raise self._refusal(home, gate, cfg, cls, priority, "full" if cfg.queue_length else "no_queue")
        waiter = Waiter(cls, fairness_key, priority, self.clock(), asyncio.get_running_loop().create_future(),
                        session=session, charge=charge, by_session=cfg.fairness == "session")
        gate.queue.push(waiter)
        self.counters["queued"] += 1
        self._wake.set()
        if await self._wait(gate, waiter, receive, cfg.max_queue_wait_s):
            ticket = waiter.handle.result()
            ticket.queued_s = self.clock() - waiter.arrival
            return home, ticket
        self.counters["rejected_wait"] += 1
        refusal = self._refusal(home, gate, cfg, cls, priority, "waited")
        refusal.queued_s = self.clock() - waiter.arrival
        raise refusal

    def release(self, pool: str, cls: str, served: float = 0.0) -> None:
        """A slot of `cls` in `pool` is free; `served`: the tokens its request was served (the pool's rate)."""
        gate = self.gates.get(pool)
        if gate is None:
            return
        gate.free_slot(cls, self.clock(), served)
        if len(gate.queue) or self._paused.get(pool):
            self._pump(pool)

    # the background lane (policies/background.py) ------------------------------------------------------------
    def headroom(self, pool: str, gate: PoolGate) -> bool:
        """Background work may go to `pool` now: no foreground class waits there, no replica is saturated, the
        foreground's recent TTFT there is within target, and some replica has a batch slot free."""
        return has_headroom(gate.queue.classes(), self.background, self.pressure(pool) or self.batches_full(pool),
                            gate.latency.within_target(self.clock()))

    def _limit(self, gate: PoolGate, pool: str, cls: str) -> int:
        limit = self._limits[cls]
        if cls not in self.background:
            return limit
        return self._window(gate, cls).limit() if self.headroom(pool, gate) else 0

    def _pool_limits(self, pool: str, gate: PoolGate) -> dict[str, int]:
        if not self.background or not any(gate.queue.queued(cls) for cls in self.background):
            return self._limits  # no background request waits: its limit decides nothing here
        for cls in self.background:
            self._window(gate, cls)
        return lane_limits(self._limits, gate.windows, self.background, self.headroom(pool, gate))

    def _window(self, gate: PoolGate, cls: str) -> BackgroundWindow:
        """Background class `cls`'s window in the pool of `gate`, with the class's current floor."""
        window = gate.window(cls, self._limits[cls])
        window.floor = self._floors.get(cls, 0)
        return window

    def set_lane_floor(self, cls: str, floor: int) -> None:
        """Background class `cls` may keep `floor` requests in flight per pool whatever its window, while there is
        headroom (batch jobs at risk of missing their deadline; policies/batch_deadline.py)."""
        if self._floors.get(cls, 0) == floor:
            return
        self._floors[cls] = floor
        for gate in self.gates.values():
            if cls in gate.windows:
                gate.windows[cls].floor = floor
        self._wake.set()  # a raised floor may let waiting background requests in

    def lane_floor(self, cls: str) -> int:
        return self._floors.get(cls, 0)

    def lane_ended(self, pool: str, cls: str, ok: bool, refused: bool) -> None:
        """A background request ended (before its slot is freed): a success grows its window, a refusal cuts it."""
        gate = self.gates.get(pool)
        if gate is None or cls not in self.background:
            return
        window = self._window(gate, cls)
        if refused:
            window.congested(self.clock())
        elif ok:
            window.succeeded(gate.in_flight.get(cls, 0))

    def foreground_ttft(self, pool: str, ttft_s: float, target_s: float) -> None:
        """A foreground stream's first token: one that missed its target cuts the pool's background windows."""
        gate = self.gates.get(pool)
        if gate is None or not self.background:
            return
        now = self.clock()
        if gate.latency.observe(now, ttft_s, target_s):
            for window in gate.windows.values():
                window.congested(now)

    def _watch_lane(self, pool: str, gate: PoolGate) -> None:
        """A saturated replica while background work runs in the pool cuts its windows (once per hold); a
        foreground request waiting on the saturated pool pauses its background streams. Without pressure, cut
        windows win back their size (`BackgroundWindow.recover`). Pressure within MADE_ROOM_GRACE_S of a pause for
        a foreground arrival cuts nothing: the pause already gave that request its slot, and vLLM's queue shows it
        until the aborted stream's slot frees."""
        running = [cls for cls in self.background if gate.in_flight.get(cls, 0)]
        now = self.clock()
        if running and self.pressure(pool):
            if now - self._made_room_at.get(pool, -math.inf) >= MADE_ROOM_GRACE_S:
                for cls in running:
                    self._window(gate, cls).congested(now)
            if self._streams.get(pool) and self.saturated(pool) \
                    and not all(cls in self.background for cls in gate.queue.classes()):
                self._pause_streams(pool)
            return
        for window in gate.windows.values():
            window.recover(now)

    def make_room(self, pool: str, url: str, in_flight: int, full_at: float) -> bool:
        """A foreground request was just sent to replica `url`, whose batch vLLM was seen running full at `full_at`
        requests: when this gateway's requests there now outnumber that, pause one background stream running there,
        so the newcomer takes its batch slot instead of waiting in vLLM's queue behind background work (the
        scraped saturation `_watch_lane` reads comes a probe interval later). True when one was paused."""
        if full_at <= 0 or in_flight <= full_at:
            return False
        for ticket in self._streams.get(pool, ()):
            stream = self._can_pause(ticket)
            if stream is not None and stream.replica == url and stream.pause():
                self.counters["paused_for_arrival"] += 1
                self._made_room_at[pool] = self.clock()
                return True
        return False

    def _pause_streams(self, pool: str) -> None:
        """Pause the pool's running background streams that have pauses left (`max_pauses` of their class)."""
        for ticket in list(self._streams.get(pool, ())):
            stream = self._can_pause(ticket)
            if stream is not None:
                stream.pause()

    def _can_pause(self, ticket: Ticket) -> Pausable | None:
        """`ticket`'s stream, if it runs (holds its slot) and has pauses left (`max_pauses` of its class)."""
        cfg = self.traffic.classes.get(ticket.cls)
        stream = ticket.stream
        if ticket.holds_slot and cfg is not None and stream is not None and stream.pauses < cfg.max_pauses:
            return stream
        return None

    def pausable(self, ticket: Ticket, stream: Pausable) -> None:
        """`stream` (its request holds `ticket`) may be paused if its class is background."""
        if ticket.cls in self.background:
            ticket.stream = stream
            self._streams.setdefault(ticket.pool, set()).add(ticket)

    def forget(self, ticket: Ticket) -> None:
        streams = self._streams.get(ticket.pool)
        if streams is not None:
            streams.discard(ticket)

    async def paused(self, ticket: Ticket) -> None:
        """`ticket`'s stream was paused: its slot goes back now; returns when the lane has room for it again
        (paused streams go on before new background requests, oldest first), or after its class's
        max_queue_wait_s whatever the lane says. Cancelled (its client left): it holds no slot and no place."""
        self.counters["paused"] += 1
        if ticket.holds_slot:
            ticket.holds_slot = False
            self.release(ticket.pool, ticket.cls)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._paused.setdefault(ticket.pool, deque())
        waiting.append((ticket, future))
        self._wake.set()
        cfg = self.traffic.classes.get(ticket.cls)
        try:
            await asyncio.wait((future,), timeout=cfg.max_queue_wait_s if cfg is not None else None)
        finally:
            if not future.done():
                future.cancel()
                waiting.remove((ticket, future))
        if not ticket.holds_slot:  # waited its longest: it goes on all the same
            self._gate(ticket.pool).take_slot(ticket.cls)
            ticket.holds_slot = True

    def lanes(self, pool: str) -> dict[str, dict[str, Any]]:
        """Per background class in `pool`: its window, requests in flight, streams paused (the status page)."""
        gate = self.gates.get(pool)
        if gate is None:
            return {}
        return {cls: {"window": w.limit(), "in_flight": gate.in_flight.get(cls, 0),
                      "paused": self.paused_streams(pool, cls)}
                for cls, w in sorted(gate.windows.items()) if cls in self.background}

    def paused_streams(self, pool: str, cls: str) -> int:
        """Streams of `cls` paused in `pool` now, waiting for the lane."""
        return sum(1 for ticket, _ in self._paused.get(pool, ()) if ticket.cls == cls)

    def _go_on(self, pool: str, gate: PoolGate) -> None:
        """Paused streams take the lane's room first, while there is headroom."""
        waiting = self._paused[pool]
        if self.saturated(pool) or not self.headroom(pool, gate):
            return
        while waiting:
            ticket, future = waiting[0]
            limit = self._limits.get(ticket.cls)
            if limit is not None and gate.in_flight.get(ticket.cls, 0) >= self._window(gate, ticket.cls).limit():
                return
            waiting.popleft()
            if not future.done():
                gate.take_slot(ticket.cls)
                ticket.holds_slot = True
                future.set_result(None)

    def _lane_busy(self) -> bool:
        return bool(self.background) and any(gate.in_flight.get(cls, 0) for gate in self.gates.values()
                                              for cls in self.background)

    def lane_view(self) -> list[tuple[str, str, int]]:
        """(pool, background class, window) for every pool a background class has been admitted to or waited on."""
        return [(pool, cls, window.limit()) for pool, gate in self.gates.items()
                for cls, window in gate.windows.items() if cls in self.background]

    # internals -----------------------------------------------------------------------------------------------
    def _gate(self, pool: str) -> PoolGate:
        gate = self.gates.get(pool)
        if gate is None:
            gate = self.gates[pool] = PoolGate.with_ledger(self.ledger)
        return gate

    def _grant(self, gate: PoolGate, pool: str, cls: str, session: str, charge: float) -> Ticket:
        gate.take_slot(cls)
        self.counters["admitted"] += 1
        if cls in self.background:
            self._wake.set()  # the ticker watches the pool's replicas while background work runs
        if session:
            self.ledger.admitted(session, charge, self.clock())
        return Ticket(self, pool, cls, session, charge)

    def _pump(self, pool: str) -> None:
        """Admit waiters of `pool` in order while slots are free; each gets its ticket through its future."""
        gate = self.gates.get(pool)
        if gate is None:
            return
        now = self.clock()
        for _ in range(2 if self.background else 1):  # again once: serving the foreground may open the lane
            if self._paused.get(pool):
                self._go_on(pool, gate)  # paused streams go on before new background requests
            if not len(gate.queue):
                return
            admitted = gate.admit_waiting(self._pool_limits(pool, gate), self.saturated(pool), now)
            if not admitted:
                return
            self._hand_out(pool, admitted, now)

    def _hand_out(self, pool: str, admitted: list[Waiter], now: float) -> None:
        for waiter in admitted:
            if waiter.session:
                self.ledger.admitted(waiter.session, waiter.charge, now)
            ticket = Ticket(self, pool, waiter.cls, waiter.session, waiter.charge)
            if waiter.handle.done():  # its handler is already gone: give the slot straight back
                ticket.release()
            else:
                self.counters["admitted"] += 1
                waiter.handle.set_result(ticket)

    async def _wait(self, gate: PoolGate, waiter: Waiter, receive: Receive, timeout_s: float) -> bool:
        """True once the waiter holds a slot (its future's result); False when it waited `timeout_s` in vain (it
        has left the queue). Raises ClientGone when the client disconnected (slot or place given back at once)."""
        future: asyncio.Future[Ticket] = waiter.handle
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((future, watch), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            gone = watch.done()
        except BaseException:  # the handler itself is being cancelled: leave no slot or queue entry behind
            self._abandon(gate, waiter)
            raise
        finally:
            watch.cancel()
        if future.done():
            ticket = future.result()  # raises the shutdown refusal, if that is what ended the wait
            if gone:
                ticket.release()
                raise ClientGone
            return True
        gate.queue.remove(waiter)
        future.cancel()
        if gone:
            self.counters["left_queue"] += 1
            raise ClientGone
        return False

    def _abandon(self, gate: PoolGate, waiter: Waiter) -> None:
        future = waiter.handle
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().release()
        else:
            gate.queue.remove(waiter)
            future.cancel()

    async def _tick(self) -> None:
        """While anything waits or background work runs, re-check every TICK_S: replica saturation and reloaded
        limits change without a slot being freed."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(TICK_S)
            for pool, gate in list(self.gates.items()):
                if self.background:
                    self._watch_lane(pool, gate)
                self._pump(pool)
            if not any(len(g.queue) for g in self.gates.values()) and not self._lane_busy() \
                    and not any(self._paused.values()):
                self._wake.clear()

    def _refusal(self, pool: str, gate: PoolGate, cfg: TrafficClassConfig, cls: str, priority: int, why: str
                 ) -> RetryLater:
        rate = gate.drain.per_second(self.clock())
        if why == "full":
            wait = retry_after_s(gate.queue.queued(cls), rate, cfg.max_queue_wait_s)
            return RetryLater(
                f"Pool '{pool}' is saturated and its queue for traffic class '{cls}' is full ({cfg.queue_length} "
                f"waiting). Retry in {wait} s (Retry-After), or send fewer requests at once.",
                status=429, code="queue_full", retry_after_s=wait)
        wait = retry_after_s(gate.queue.ahead(priority), rate, cfg.max_queue_wait_s)
        if why == "waited":
            message = (f"Pool '{pool}' had no free slot for traffic class '{cls}' within {cfg.max_queue_wait_s:g} s "
                       f"(max_queue_wait_s). It is overloaded; retry in {wait} s (Retry-After).")
        else:
            message = (f"Pool '{pool}' has no capacity for traffic class '{cls}' right now and this class does not "
                       f"queue (queue_length: 0). Retry in {wait} s (Retry-After).")
        return RetryLater(message, status=503, type="server_error",
                          code="queue_timeout" if why == "waited" else "no_capacity", retry_after_s=wait)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True, slots=True)
class Admitted:
    """The pools to forward to (the admitted one first) and the `priority` to send to vLLM, if any."""

    choice: PoolChoice
    priority: int | None


class TrafficControl:
    """Keys, input limits, classes, rate limits and admission for one gateway process."""

    def __init__(self, config: GatewayConfig, clock: Callable[[], float], saturated: Callable[[str], bool],
                 pressure: Callable[[str], bool] | None = None, batches_full: Callable[[str], bool] | None = None
                 ) -> None:
        self.config = config
        self.clock = clock
        self.keys = KeyStore(config.access.all_keys())
        access = config.access
        self.rate = RateLimiter(access.rate_limit_redis or config.state, prefix=access.rate_limit_prefix,
                                timeout_s=access.redis_timeout_s, retry_s=access.redis_retry_s)
        self.admission = AdmissionControl(config.traffic, clock, saturated, pressure, batches_full)
        self._ttft: dict[str, deque[float]] = {}
        self._by_size = config.pools_by_size()  # sorted once per config, not per request

    def apply_config(self, config: GatewayConfig) -> list[str]:
        """Keys, classes and limits change at once; returns notes about what needs a restart."""
        notes = []
        old = self.config.access
        if (old.rate_limit_redis or self.config.state) != (config.access.rate_limit_redis or config.state):
            notes.append("the rate-limit Redis URL changes on restart")
        self.config = config
        self._by_size = config.pools_by_size()
        self.keys = KeyStore(config.access.all_keys())
        self.admission.apply_config(config.traffic)
        return notes

    async def start(self) -> None:
        if self.keys.open:
            log.warning(OPEN_GATEWAY_WARNING)
        await self.rate.start()
        self.admission.start()

    async def stop(self) -> None:
        await self.admission.stop()
        await self.rate.stop()

    # request path --------------------------------------------------------------------------------------------
    def authenticate(self, request: Request) -> Client:
        inner = request.scope.get(IN_PROCESS_CLIENT)
        if inner is not None:  # the gateway's own request (a batch line), already authenticated as its job's owner
            return inner  # type: ignore[no-any-return]
        check_header_size(request.scope["headers"], self.config.limits.max_header_bytes)
        return self.keys.authenticate(request.headers)

    def body_deadline(self) -> Any:
        return body_deadline(self.config.limits.body_read_timeout_s)

    def check_input(self, body: dict[str, Any], api: str) -> None:
        check_input_limits(body, api, self.config.limits)

    async def admit(self, request: Request, record: RequestRecord, client: Client, profile: RequestProfile,
                    choice: PoolChoice, session: str | None = None) -> Admitted:
        """Key's pools (403) → class → rate limits (429) → a slot (queue, spill, 429, 503); sets the record's
        traffic_class and t_admitted, and keeps the slot on the record until `finished`. `session`: the sticky
        session key, when agent sessions are not tracked (`record.session` names it when they are)."""
        traffic = self.config.traffic
        key = client.key
        if key is not None:
            choice = restrict_to_key(choice, key, forced=choice.reason == "forced")
        cls = resolve_class(traffic, self._by_size, _natural_pool(choice),
                            raw_header(request.scope["headers"], _CLASS_HEADER_RAW), key)
        record.traffic_class = cls
        priority = request_priority(traffic, cls, profile.thinking_mode)
        if key is not None and (key.requests_per_minute or key.tokens_per_minute):
            await self._rate_limit(client, profile, record)
        names = [p.name for p in choice.candidates]
        try:
            fair = fairness_session(record, client.key_id, session)
            charge = self.admission.ledger.turn_charge(fair, float(profile.prompt_tokens), self.clock())
            pool, ticket = await self.admission.admit(request.receive, names, cls, priority, client.key_id, fair,
                                                      charge)
        except RetryLater as exc:
            record.queue_s = exc.queued_s
            raise
        except ClientGone:
            record.client_disconnected = True
            raise RequestRejected("The client closed the connection while its request waited for capacity.",
                                  status=499, code="client_closed_request") from None
        record.admission_ticket = ticket
        record.queue_s = ticket.queued_s
        record.t_admitted = self.clock()
        if pool != choice.pool.name:
            at = names.index(pool)
            choice = replace(choice, pool=choice.candidates[at], candidates=choice.candidates[at:],
                             reason=f"spill:{choice.pool.name}")
        if choice.pool.scheduling_policy != "priority":
            return Admitted(choice, None)
        # vLLM refuses a priority it does not schedule by: only pools that do may take this request, even on retry
        same = tuple(p for p in choice.candidates if p.scheduling_policy == "priority")
        return Admitted(choice if len(same) == len(choice.candidates) else replace(choice, candidates=same), priority)

    async def _rate_limit(self, client: Client, profile: RequestProfile, record: RequestRecord) -> None:
        key = client.key
        if key is None or not (key.requests_per_minute or key.tokens_per_minute):
            return
        cost = profile.prompt_tokens + profile.output_budget
        if key.tokens_per_minute and cost > key.tokens_per_minute:
            raise RequestRejected(
                f"Request too large for API key '{key.name}' on tokens per minute (TPM): limit "
                f"{key.tokens_per_minute:,}, requested about {cost:,} (prompt estimate + output budget). Lower "
                "max_tokens or shorten the input.",
                status=429, type="tokens", code="rate_limit_exceeded")
        decision = await self.rate.check(client.key_id, key.requests_per_minute, key.tokens_per_minute, cost)
        record.ratelimit_headers = rate_limit_headers(decision)
        if decision is None or decision.allowed:
            return
        requests = decision.requests is not None and decision.requests.remaining < 1
        dim, quota = ("requests", decision.requests) if requests else ("tokens", decision.tokens)
        assert quota is not None
        wait = max(1, math.ceil(decision.retry_after_s))
        raise RetryLater(
            f"Rate limit reached for {dim} per minute on API key '{key.name}': limit {quota.limit:,}, remaining "
            f"{quota.remaining:,}, requested {1 if requests else cost:,}. Please try again in "
            f"{openai_duration(decision.retry_after_s)}.",
            status=429, type=dim, code="rate_limit_exceeded", retry_after_s=wait)

    def response_headers(self, record: RequestRecord) -> dict[str, str]:
        """The gateway's headers on every answer, served or refused: `x-m3gate-queue-ms` (time in the admission
        queue) and OpenAI's x-ratelimit-* once the key's quota was checked."""
        limits = record.ratelimit_headers
        queued = {QUEUE_MS_HEADER: queue_ms(record.queue_s)}
        return {**limits, **queued} if limits else queued

    def refusal_headers(self, record: RequestRecord, exc: RequestRejected) -> dict[str, str]:
        headers = dict(self.response_headers(record))
        if isinstance(exc, RetryLater):
            headers["retry-after"] = str(exc.retry_after_s)
        return headers

    def finished(self, record: RequestRecord) -> None:
        """The upstream request has ended (or never started): free its slot, note its first-token latency."""
        ticket, record.admission_ticket = record.admission_ticket, None
        if ticket is not None:
            self._lane_outcome(ticket, record)
            prompt, completion, cached = record.tokens()
            ticket.release(max(0, prompt - cached) + completion, completion)
            if record.stream and record.status == 200 and record.t_first_byte and record.traffic_class:
                samples = self._ttft.setdefault(record.traffic_class, deque(maxlen=_TTFT_SAMPLES))
                samples.append(record.t_first_byte - record.t_arrival)

    def _lane_outcome(self, ticket: Ticket, record: RequestRecord) -> None:
        """What the background lane learns from a request that ended: a background one's success or refusal, a
        foreground stream's time to first token against its class's target."""
        admission = self.admission
        if not admission.background:
            return
        if ticket.cls in admission.background:
            ok = record.status == 200 and record.error is None and not record.client_disconnected
            admission.lane_ended(ticket.pool, ticket.cls, ok, record.status == 429 or record.status >= 500)
            return
        cfg = self.config.traffic.classes.get(ticket.cls)
        if cfg is not None and record.stream and record.status == 200 and record.t_first_byte:
            admission.foreground_ttft(ticket.pool, record.t_first_byte - record.t_arrival, cfg.ttft_target_s)

    # operators -----------------------------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """What GET /admin/traffic shows: per pool and class, slots in use and waiting; per class, observed
        time to first token against its target; the rate limiter's backend; counters since start; how many sessions'
        attained service is kept (session-fair ordering)."""
        now = self.clock()
        classes = self.config.traffic.classes
        pools = {}
        admission = self.admission
        for name, gate in admission.gates.items():
            pools[name] = {
                "drain_per_s": round(gate.drain.per_second(now) or 0.0, 3),
                "saturated": admission.saturated(name),
                "classes": {c: {"in_flight": gate.in_flight.get(c, 0), "queued": gate.queue.queued(c)}
                            for c in sorted({*gate.in_flight, *(w.cls for w in gate.queue)})},
            }
            lanes = admission.lanes(name)
            if lanes:
                headroom = admission.headroom(name, gate)
                pools[name]["background"] = {c: {**lane, "size": round(gate.windows[c].size, 2), "headroom": headroom,
                                                 "increases": gate.windows[c].increases,
                                                 "decreases": gate.windows[c].decreases,
                                                 "floor": gate.windows[c].floor}
                                             for c, lane in lanes.items()}
        ttft = {}
        for cls, cfg in classes.items():
            samples = sorted(self._ttft.get(cls, ()))
            p95 = samples[min(len(samples) - 1, math.ceil(0.95 * len(samples)) - 1)] if samples else None
            ttft[cls] = {"priority": cfg.priority, "fairness": cfg.fairness, "max_concurrency": cfg.max_concurrency,
                         "background": cfg.background,
                         "queue_length": cfg.queue_length, "max_queue_wait_s": cfg.max_queue_wait_s,
                         "ttft_target_s": cfg.ttft_target_s, "ttft_p95_s": None if p95 is None else round(p95, 4),
                         "ttft_samples": len(samples),
                         "meets_target": None if p95 is None else p95 <= cfg.ttft_target_s}
        return {"open": self.keys.open, "keys": len(self.config.access.all_keys()),
                "rate_limits": "redis" if self.rate.shared else "memory",
                "classes": ttft, "pools": pools, "counters": dict(self.admission.counters),
                "sessions_served": len(self.admission.ledger)}


_CLASS_HEADER_RAW = CLASS_HEADER.encode("latin-1")


def raw_header(raw: Sequence[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header `name` (lower case), as `request.headers.get` reads it (ASGI servers lower-case
    header names) without its KeyError when the header is absent, which is the usual case."""
    for key, value in raw:
        if key == name:
            return value.decode("latin-1")
    return None


def fairness_session(record: RequestRecord, key_id: str, session: str | None) -> str:
    """The session whose attained service a request counts in: the agent session the gateway derived
    (gateway/sessions.py: headers, body, inferred turns; a first turn has its own id, which a later turn may
    continue), else the sticky session key. Scoped by API key: two keys' equal session ids are two sessions. ""
    for a request the gateway knows no session of: its own session, which no earlier service can be charged to, so
    it is kept nowhere."""
    turn = record.session
    if turn is not None:
        named = getattr(turn, "session_id", None) or turn.session.id  # a one-shot turn names its own id
        return f"{key_id}\0{named}"
    return f"{key_id}\0{session}" if session else ""


def _natural_pool(choice: PoolChoice) -> str:
    """The pool that fits the request, before pool choice spilled it past a saturated one: its class is the
    request's default class wherever it ends up."""
    return choice.reason[6:] if choice.reason.startswith("spill:") else choice.pool.name
