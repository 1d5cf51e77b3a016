"""Routing state shared between gateway processes, so that gateways behind one load balancer route like one.

What is shared: which replica each request's prefix blocks were sent to (so every gateway's prefix index learns it),
session pins, and each gateway's in-flight count per replica. Peers do the same through Redis (LiteLLM's DualCache
for pins and least-busy counts, AIBrix's statesync for the prefix table); unlike a per-request Redis round trip,
nothing here is awaited on the request path:

- `on_dispatch` appends `(pool, replica, request)` to a bounded in-process buffer (no I/O, no encoding).
- A flusher task, every `flush_interval_s`, sends ONE pipeline: an XADD of the buffered dispatches, packed as one
  binary batch, to the model's stream (`MAXLEN ~`, so the stream stays bounded), and a SET of this gateway's
  in-flight snapshot with a short TTL (so a gateway that dies stops counting within seconds), plus its id in a
  registry set.
- A reader task blocks on XREAD and hands other gateways' dispatches to `apply_remote` (the policy's `dispatched`).
- With a `sessions` sync (pools/sessions.py's SessionStore), the same flush also carries the answers that ended since
  the last one (session id, tool-call ids, history key, wall-clock times), encoded by the store, in the same stream
  entry; the reader hands other gateways' to `sessions.apply_events`, so a session whose turns alternate between
  gateways is one session everywhere.
- A poller task reads the other gateways' snapshots every `poll_interval_s` and sums them per replica;
  `remote_in_flight` is then a dict lookup.
- The capacity signal (gateway/capacity/signal.py) calls `exchange_capacity` once per `capacity.interval_s`: ONE
  pipeline that SETs this gateway's demand share (policies/demand_share.py's bytes, TTL a few intervals) and MGETs the
  other live gateways' (the registry as the poller last read it), so every gateway sizes the pools from the same demand.

Redis is an optimisation, never a dependency: when it is unreachable the gateway routes from its own view, logs once,
keeps only the newest `max_buffer` dispatches, reconnects with back-off and, once Redis answers again, catches up (the
reader resumes after the last entry it saw, the flusher re-publishes its snapshot and the dispatches it kept).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from policies.snapshot import RoutingRequest

__all__ = [
    "ApplyRemote",
    "LocalState",
    "RedisState",
    "SessionSync",
    "SharedState",
    "SharedStateCounters",
    "build_shared_state",
    "decode_batch",
    "encode_batch",
    "encode_dispatch",
]

log = logging.getLogger("m3gate.shared_state")

ApplyRemote = Callable[[str, str, RoutingRequest], None]
"""How a remote dispatch is applied locally: (pool, replica url, request) → the pool policy's `dispatched`."""

LocalInFlight = Callable[[], Mapping[str, int]]
"""This gateway's own in-flight requests per replica url."""


class SessionSync(Protocol):
    """What the shared state needs from the session store (pools/sessions.py): its records are opaque bytes here."""

    def pending_events(self) -> int:
        """Answer records waiting to be published."""

    def drain_events(self, limit: int) -> tuple[bytes, int]:
        """Up to `limit` waiting records as one encoded batch, and their number; (b"", 0) when none."""

    def apply_events(self, blob: bytes) -> int:
        """Apply another gateway's batch; the number of records; ValueError / struct.error when malformed."""


@dataclass(slots=True)
class SharedStateCounters:
    """Monotonic counters for the metrics layer (read them; never reset them)."""

    flushes: int = 0  # pipelines sent
    entries_sent: int = 0  # dispatches published
    entries_received: int = 0  # other gateways' dispatches read from the stream
    entries_applied: int = 0  # other gateways' dispatches applied locally
    entries_dropped: int = 0  # dispatches never published (buffer full, or lost with a failed flush)
    polls: int = 0  # successful reads of the other gateways' in-flight snapshots
    errors: int = 0  # failed Redis operations (connection or command)
    apply_errors: int = 0  # apply_remote raised (a bug: counted and logged once, never propagated)
    disconnects: int = 0  # times Redis became unreachable
    reconnects: int = 0  # times it came back
    session_events_sent: int = 0  # answer records published (pools/sessions.py)
    session_events_received: int = 0  # other gateways' answer records applied
    session_events_dropped: int = 0  # answer records lost with a failed flush
    capacity_exchanges: int = 0  # demand shares published (one pipeline each, with the read of the others')
    capacity_shares_read: int = 0  # other gateways' demand shares read

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class SharedState(Protocol):
    available: bool
    counters: SharedStateCounters

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def on_dispatch(self, pool: str, replica: str, request: RoutingRequest) -> None:
        """This gateway sent `request` to `replica` (called on the hot path: must not block or await)."""

    def remote_in_flight(self, replica: str) -> int:
        """In-flight requests other gateways currently have on `replica`."""

    async def exchange_capacity(self, share: bytes, ttl_s: float) -> list[tuple[str, bytes]] | None:
        """Publish this gateway's demand share (kept `ttl_s`) and return every live gateway's as (gateway id, share),
        this one's included; None when there is nothing to share with (memory state, Redis unreachable)."""


class LocalState:
    """No sharing: a single gateway process (or `state:` unset)."""

    available = True

    def __init__(self) -> None:
        self.counters = SharedStateCounters()

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def on_dispatch(self, pool: str, replica: str, request: RoutingRequest) -> None:
        return None

    def remote_in_flight(self, replica: str) -> int:
        return 0

    async def exchange_capacity(self, share: bytes, ttl_s: float) -> list[tuple[str, bytes]] | None:
        return None


# -- wire format ---------------------------------------------------------------------------------------------------
# One stream entry per flush, not per dispatch: {g: gateway id, d: batch}, plus s: the session store's batch of answer
# records when there is one (its format is pools/sessions.py's; an entry may carry s alone; a gateway without session
# support (older versions) logs an s-only entry once as malformed and skips it). redis-py builds commands and (without
# hiredis) parses replies in Python, so an XADD per dispatch cost ~55 µs per dispatch to send (a flush of 100: 5.5 ms)
# and again to parse on every reader; batched, a flush of 100 takes ~0.7 ms and a reader parses one field. The batch
# is a version byte, then per dispatch a fixed header (flags: bit 0 = has a session key, bit 1 = hashes are signed;
# the lengths of pool, replica and session key; the number of hashes; prompt tokens and output budget), the three
# UTF-8 strings, and the block hashes as little-endian 64-bit integers. Only the leading `max_blocks` hashes travel:
# hashes are chained, so the leading ones identify the prefix, and a few hundred blocks are ~30K+ tokens of it.

WIRE_VERSION = 1
_HEADER = struct.Struct("<BHHIHqq")
_HAS_SESSION, _SIGNED = 1, 2
_MAX_BLOCKS = 256
_MAX_STRING = 0xFFFF


def encode_dispatch(pool: str, replica: str, request: RoutingRequest, max_blocks: int = _MAX_BLOCKS) -> bytes:
    """One dispatch's record in a batch (see the format above)."""
    hashes = request.block_hashes[:min(max_blocks, 0xFFFF)]
    flags = 0
    packed = b""
    if hashes:
        try:
            packed = struct.pack(f"<{len(hashes)}Q", *hashes)
        except struct.error:
            try:
                packed = struct.pack(f"<{len(hashes)}q", *hashes)
                flags |= _SIGNED
            except struct.error:  # not 64-bit integers: share the session and load, not the prefix
                hashes = ()
    pool_b, replica_b = pool.encode()[:_MAX_STRING], replica.encode()[:_MAX_STRING]
    session_b = b""
    if request.session_key is not None:
        flags |= _HAS_SESSION
        session_b = request.session_key.encode()
    header = _HEADER.pack(flags, len(pool_b), len(replica_b), len(session_b), len(packed) // 8,
                          request.prompt_tokens, request.output_budget)
    return b"".join((header, pool_b, replica_b, session_b, packed))


def encode_batch(records: list[bytes]) -> bytes:
    return bytes((WIRE_VERSION,)) + b"".join(records)


def decode_batch(blob: bytes) -> list[tuple[str, str, RoutingRequest]]:
    """(pool, replica, request) per dispatch of a batch; raises ValueError or struct.error if it is malformed."""
    if not blob or blob[0] != WIRE_VERSION:
        raise ValueError(f"unknown wire version {blob[:1]!r}")
    out: list[tuple[str, str, RoutingRequest]] = []
    names: dict[bytes, str] = {}  # pools and replicas repeat: decode each once per batch
    view = memoryview(blob)
    pos, end, header_size = 1, len(blob), _HEADER.size
    while pos < end:
        flags, n_pool, n_replica, n_session, n_hashes, prompt_tokens, output_budget = _HEADER.unpack_from(blob, pos)
        pos += header_size
        strings_end = pos + n_pool + n_replica + n_session
        hashes_end = strings_end + 8 * n_hashes
        if hashes_end > end:
            raise ValueError("truncated dispatch record")
        pool_b = bytes(view[pos:pos + n_pool])
        replica_b = bytes(view[pos + n_pool:pos + n_pool + n_replica])
        pool = names.get(pool_b) or names.setdefault(pool_b, pool_b.decode())
        replica = names.get(replica_b) or names.setdefault(replica_b, replica_b.decode())
        session = bytes(view[pos + n_pool + n_replica:strings_end]).decode() if flags & _HAS_SESSION else None
        hashes: tuple[int, ...] = ()
        if n_hashes:
            hashes = struct.unpack_from(f"<{n_hashes}{'q' if flags & _SIGNED else 'Q'}", blob, strings_end)
        out.append((pool, replica, RoutingRequest(prompt_tokens, output_budget, hashes, session)))
        pos = hashes_end
    return out


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _redacted(url: str) -> str:
    """host:port/db of a Redis URL, for logs (never the password)."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname or ''}{port}{parts.path}"


# Losing the connection (refused, reset, timed out): Redis is unavailable until a PING answers again.
_READ_BATCHES = 16  # stream entries (one flush each) per XREAD

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError, EOFError,
)
_REDIS_ERRORS: tuple[type[BaseException], ...] = (*_CONNECTION_ERRORS, RedisError)

_Entries = list[tuple[bytes, dict[bytes, bytes]]]  # XRANGE-style entries (decode_responses=False)
_Streams = list[tuple[bytes, _Entries]]  # XREAD's reply


class RedisState:
    """Routing state shared through Redis: a dispatch stream per model and per-gateway in-flight snapshots.

    Keys, under `key_prefix` (one prefix per model, e.g. "m3gate:MiniMaxAI/MiniMax-M3:"):
    `dispatch` (stream of {g: gateway id, d: batch, s: session records}), `gateways` (set of live gateway ids),
    `inflight:<id>` (JSON {url: count}, TTL), `capacity:<id>` (the capacity signal's demand share, TTL).
    Counters count dispatches, not stream entries.
    """

    def __init__(
        self,
        url: str,
        apply_remote: ApplyRemote,
        local_in_flight: LocalInFlight,
        *,
        key_prefix: str = "m3gate:default:",
        flush_interval_s: float = 0.025,
        poll_interval_s: float = 0.1,
        read_block_ms: int = 100,
        inflight_ttl_s: float = 3.0,
        max_buffer: int = 4096,
        max_batch: int = 1024,
        max_blocks: int = _MAX_BLOCKS,
        stream_maxlen: int = 1024,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        gateway_id: str | None = None,
        sessions: SessionSync | None = None,
    ) -> None:
        if flush_interval_s <= 0 or poll_interval_s <= 0 or inflight_ttl_s <= 0 or max_buffer <= 0 or max_batch <= 0:
            raise ValueError("intervals, TTL and buffer sizes must be positive")
        self.url = url
        self.apply_remote = apply_remote
        self.local_in_flight = local_in_flight
        self.sessions = sessions
        self.flush_interval_s = flush_interval_s
        self.poll_interval_s = poll_interval_s
        self.read_block_ms = read_block_ms
        self.inflight_ttl_s = inflight_ttl_s
        self.max_buffer = max_buffer
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.stream_maxlen = stream_maxlen
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.gateway_id = gateway_id or secrets.token_hex(8)
        self._gid = self.gateway_id.encode()
        self.stream_key = f"{key_prefix}dispatch"
        self.registry_key = f"{key_prefix}gateways"
        self._inflight_prefix = f"{key_prefix}inflight:"
        self.inflight_key = self._inflight_prefix + self.gateway_id
        self._capacity_prefix = f"{key_prefix}capacity:".encode()
        self.capacity_key = self._capacity_prefix + self._gid
        self.available = False
        self.counters = SharedStateCounters()
        # Retries are ours (back-off, one log line per outage): redis-py must fail fast instead of retrying each call.
        self._client = aioredis.Redis.from_url(
            url, socket_connect_timeout=connect_timeout_s, socket_timeout=max(2.0, read_block_ms / 1000 + 1.0),
            retry=Retry(NoBackoff(), 0), decode_responses=False,
        )
        self._buffer: deque[tuple[str, str, RoutingRequest]] = deque(maxlen=max_buffer)
        self._remote: dict[str, int] = {}
        self._peers: list[bytes] = []  # the other live gateways' ids, as the poller last read the registry
        self._up = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._backoff_s = backoff_initial_s
        self._last_id: bytes | None = None  # last stream entry the reader saw
        self._check_tail = True  # compare the stream's tail with _last_id before the next read (start, reconnect)
        self._published: dict[str, int] | None = None
        self._published_at = 0.0
        self._logged: set[str] = set()
        self._epoch = 0  # bumped on each (re)connection, see `_lost`
        self._stopping = False
        self._stop_signal: asyncio.Future[None] | None = None

    # -- hot path ------------------------------------------------------------------------------------------------

    def on_dispatch(self, pool: str, replica: str, request: RoutingRequest) -> None:
        """Buffer only: the flusher encodes and sends. When full, the oldest dispatch is dropped (bounded memory)."""
        buffer = self._buffer
        if len(buffer) == self.max_buffer:
            self.counters.entries_dropped += 1
        buffer.append((pool, replica, request))

    def remote_in_flight(self, replica: str) -> int:
        return self._remote.get(replica, 0)

    @property
    def buffered(self) -> int:
        """Dispatches waiting to be published."""
        return len(self._buffer)

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (briefly) and start the tasks. Never raises for Redis: an absent Redis is retried in background."""
        if self._tasks:
            return
        self._stopping = False
        self._stop_signal = asyncio.get_running_loop().create_future()
        try:
            await self._client.ping()
            self._recovered(first=True)
            await self._sync_position()  # fix `$` now: what others publish once start() returns is read
        except _REDIS_ERRORS as exc:  # a RedisError (e.g. NOAUTH) also means: route locally
            self._lost(exc, self._epoch)
        loops = (
            ("flush", "flush", self._flush_step, False, self.flush_interval_s),
            ("read", "stream read", self._read_step, True, self.poll_interval_s),
            ("poll", "in-flight poll", self._poll_step, True, self.poll_interval_s),
        )
        self._tasks = [
            asyncio.create_task(self._supervised(name, what, step, wait_up=wait_up, pause_after_error_s=pause),
                                name=f"shared-state-{name}")
            for name, what, step, wait_up, pause in loops
        ]

    async def stop(self) -> None:
        """Stop the tasks, publish what is buffered and withdraw this gateway's in-flight snapshot (best effort,
        bounded: at most a couple of seconds even when Redis hangs)."""
        tasks, self._tasks = self._tasks, []
        self._stopping = True
        if self._stop_signal is not None and not self._stop_signal.done():
            self._stop_signal.set_result(None)
        self._up.set()  # wake the waiters: they see _stopping and return
        await self._settle(tasks, self.read_block_ms / 1000 + 0.5)
        if self.available:
            await self._settle([asyncio.create_task(self._goodbye())], 0.5)
        self.available = False
        self._up.clear()
        self._remote = {}
        self._peers = []
        try:
            await self._client.aclose()
        except _REDIS_ERRORS:
            pass

    async def _settle(self, tasks: list[asyncio.Task[None]], timeout: float) -> None:
        """Let `tasks` end on their own (they check `_stopping` between commands), then cancel stragglers.

        Cancelling a redis-py command can be swallowed inside its reader (seen about once in a few hundred cancelled
        blocking XREADs: the task then waits forever), so a straggler that survives its cancel gets its connections
        closed under it, and one that survives even that is abandoned rather than hanging the shutdown."""
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        if pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.5)
        if pending:
            await self._client.connection_pool.disconnect()
            _, pending = await asyncio.wait(pending, timeout=0.5)
        if pending:
            log.error("shared state: %d task(s) did not stop; abandoned", len(pending))

    async def _goodbye(self) -> None:
        pipe = self._client.pipeline(transaction=False)
        events, _ = self._take_session_events()
        self._queue_dispatches(pipe, self._take_batch(), events)
        pipe.delete(self.inflight_key, self.capacity_key)
        pipe.srem(self.registry_key, self._gid)
        await pipe.execute()

    async def _idle(self, seconds: float) -> None:
        """Sleep, but wake at once on stop (so stop never has to cancel a task, see `_settle`)."""
        if seconds > 0 and self._stop_signal is not None:
            await asyncio.wait((self._stop_signal,), timeout=seconds)
        else:
            await asyncio.sleep(0)

    # -- availability --------------------------------------------------------------------------------------------

    def _lost(self, exc: BaseException, epoch: int) -> None:
        """A Redis call failed on the connection: route locally until a PING answers. Logged once per outage.

        `epoch` is when the failed call started: a call begun before the last reconnect failing late (on a connection
        of the previous outage) says nothing about Redis now."""
        self.counters.errors += 1
        if epoch != self._epoch:
            return
        self._remote = {}  # other gateways' counts can no longer be refreshed: do not let them linger
        self._peers = []
        if "outage" not in self._logged:
            self.counters.disconnects += 1
            self._logged.add("outage")
            log.warning("shared state: Redis at %s unreachable (%s: %s); routing from this gateway's view, "
                        "retrying with back-off", _redacted(self.url), type(exc).__name__, exc)
        self.available = False
        self._up.clear()

    def _recovered(self, first: bool = False) -> None:
        if not first:
            self.counters.reconnects += 1
            log.warning("shared state: Redis at %s is reachable again; resynchronising", _redacted(self.url))
        self._logged.discard("outage")
        self._epoch += 1
        self._backoff_s = self.backoff_initial_s
        self._check_tail = True
        self._published = None  # re-publish the in-flight snapshot at once
        self.available = True
        self._up.set()

    def _log_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.error(message, *args)

    def _log_bug_once(self, key: str, what: str) -> None:
        """An unexpected exception (a bug): counted, logged with its traceback once, never propagated."""
        self.counters.errors += 1
        if key not in self._logged:
            self._logged.add(key)
            log.exception("shared state: %s failed", what)

    async def _reconnect(self) -> None:
        await self._idle(self._backoff_s)
        self._backoff_s = min(self._backoff_s * 2, self.backoff_max_s)
        if self._stopping:
            return
        # Idle pooled connections died with the old server; without this the first commands after the PING would
        # fail on them and declare a second outage.
        await self._client.connection_pool.disconnect(inuse_connections=False)
        await self._client.ping()
        self._recovered()

    async def _supervised(self, name: str, what: str, step: Callable[[], Awaitable[float]], *, wait_up: bool,
                          pause_after_error_s: float) -> None:
        """Run `step` until stop, never letting it end the loop: a lost connection means `_lost` (route locally until
        a PING answers), a command error is counted and logged once per kind, a bug once with its traceback. `step`
        returns how long to idle before its next turn; `wait_up`: only run while Redis is reachable."""
        while not self._stopping:
            if wait_up:
                await self._up.wait()
                if self._stopping:
                    return
            epoch = self._epoch
            try:
                pause = await step()
            except _CONNECTION_ERRORS as exc:
                self._lost(exc, epoch)
                continue
            except RedisError as exc:  # a command error (e.g. WRONGTYPE, OOM): the connection is fine
                self.counters.errors += 1
                self._log_once(f"{name}:{type(exc).__name__}", "shared state: %s failed: %s", what, exc)
                pause = pause_after_error_s
            except Exception:  # a bug must not stop sharing for the process's lifetime
                self._log_bug_once(f"{name}:bug", what)
                pause = pause_after_error_s
            await self._idle(pause)

    # -- flusher -------------------------------------------------------------------------------------------------

    async def _flush_step(self) -> float:
        """Reconnect while Redis is away, else publish; no pause while a backlog (after an outage) drains, one batch
        per turn."""
        if not self.available:
            await self._reconnect()
            return 0.0
        await self.flush()
        if len(self._buffer) >= self.max_batch or \
                (self.sessions is not None and self.sessions.pending_events() >= self.max_batch):
            return 0.0
        return self.flush_interval_s

    def _take_batch(self) -> list[tuple[str, str, RoutingRequest]]:
        buffer = self._buffer
        return [buffer.popleft() for _ in range(min(len(buffer), self.max_batch))]

    def _take_session_events(self) -> tuple[bytes, int]:
        return self.sessions.drain_events(self.max_batch) if self.sessions is not None else (b"", 0)

    def _queue_dispatches(self, pipe: Any, batch: list[tuple[str, str, RoutingRequest]], events: bytes = b"") -> None:
        if batch or events:
            fields = {b"g": self._gid}
            if batch:
                max_blocks = self.max_blocks
                fields[b"d"] = encode_batch([encode_dispatch(pool, replica, req, max_blocks)
                                             for pool, replica, req in batch])
            if events:
                fields[b"s"] = events
            pipe.xadd(self.stream_key, fields, maxlen=self.stream_maxlen, approximate=True)

    async def flush(self) -> None:
        """Publish buffered dispatches and this gateway's in-flight snapshot in one pipeline (one round trip).

        Skipped when there is nothing new: no dispatch, no session record, same snapshot, published less than a
        quarter TTL ago."""
        batch = self._take_batch()
        events, n_events = self._take_session_events()
        snapshot = {url: n for url, n in self.local_in_flight().items() if n > 0}
        now = time.monotonic()
        if not batch and not n_events and snapshot == self._published \
                and now - self._published_at < self.inflight_ttl_s / 4:
            return
        pipe = self._client.pipeline(transaction=False)
        self._queue_dispatches(pipe, batch, events)
        ttl_ms = int(self.inflight_ttl_s * 1000)
        pipe.set(self.inflight_key, orjson.dumps(snapshot), px=ttl_ms)
        pipe.sadd(self.registry_key, self._gid)
        pipe.pexpire(self.registry_key, max(ttl_ms * 20, 60_000))
        try:
            await pipe.execute()
        except BaseException:
            self.counters.entries_dropped += len(batch)
            self.counters.session_events_dropped += n_events
            raise
        self._published, self._published_at = snapshot, now
        self.counters.flushes += 1
        self.counters.entries_sent += len(batch)
        self.counters.session_events_sent += n_events

    # -- reader --------------------------------------------------------------------------------------------------

    async def _read_step(self) -> float:
        """One blocking XREAD of other gateways' entries (it waits up to read_block_ms itself: no pause after)."""
        if self._check_tail:
            await self._sync_position()
        assert self._last_id is not None
        response = await self._client.xread({self.stream_key: self._last_id}, count=_READ_BATCHES,
                                            block=self.read_block_ms)
        if response:  # RESP2 (the client's protocol): [[stream, [(id, {field: value}), ...]]]
            await self._apply(cast(_Streams, response)[0][1])
        return 0.0

    async def _sync_position(self) -> None:
        """At start read only what comes next (XREAD `$`, without missing what is added before the first read);
        after an outage resume after the last entry seen, unless the stream was recreated (Redis restarted empty
        or was flushed): then everything in it is new."""
        tail = cast(_Entries, await self._client.xrevrange(self.stream_key, count=1))
        tail_id = tail[0][0] if tail else b"0-0"
        if self._last_id is None:
            self._last_id = tail_id
        elif _stream_id(tail_id) < _stream_id(self._last_id):
            self._last_id = b"0-0"
        self._check_tail = False

    async def _apply(self, entries: _Entries) -> None:
        """Apply other gateways' batches, yielding to the event loop between batches: a catch-up after an outage
        (up to `stream_maxlen` batches) must not stall the requests this gateway is serving."""
        own = self._gid
        counters = self.counters
        for entry_id, fields in entries:
            await asyncio.sleep(0)
            self._last_id = entry_id
            if fields.get(b"g") == own:
                continue
            events = fields.get(b"s")
            try:
                blob = fields.get(b"d")
                if blob is None and events is None:
                    raise KeyError(b"d")
                dispatches = decode_batch(blob) if blob is not None else []
            except (KeyError, ValueError, struct.error, UnicodeDecodeError):
                counters.errors += 1
                self._log_once("decode", "shared state: ignoring a malformed entry %r in %s", entry_id,
                               self.stream_key)
                continue
            counters.entries_received += len(dispatches)
            for pool, replica, request in dispatches:
                try:
                    self.apply_remote(pool, replica, request)
                except Exception:
                    counters.apply_errors += 1
                    if "apply" not in self._logged:
                        self._logged.add("apply")
                        log.exception("shared state: applying a remote dispatch failed")
                    continue
                counters.entries_applied += 1
            if events is not None and self.sessions is not None:
                self._apply_session_events(entry_id, events)

    def _apply_session_events(self, entry_id: bytes, events: bytes) -> None:
        assert self.sessions is not None
        try:
            self.counters.session_events_received += self.sessions.apply_events(events)
        except (ValueError, struct.error, UnicodeDecodeError):
            self.counters.errors += 1
            self._log_once("decode-sessions", "shared state: ignoring malformed session records in %r of %s",
                           entry_id, self.stream_key)
        except Exception:
            self.counters.apply_errors += 1
            if "apply-sessions" not in self._logged:
                self._logged.add("apply-sessions")
                log.exception("shared state: applying remote session records failed")

    # -- poller --------------------------------------------------------------------------------------------------

    async def _poll_step(self) -> float:
        await self.poll()
        return self.poll_interval_s

    async def poll(self) -> None:
        """Sum the other live gateways' in-flight snapshots per replica; forget gateways whose snapshot expired."""
        members = cast("set[bytes]", await self._client.smembers(self.registry_key))
        others = sorted(m for m in members if m != self._gid)
        totals: dict[str, int] = {}
        if others:
            values = await self._client.mget([self._inflight_prefix.encode() + m for m in others])
            gone = [m for m, v in zip(others, values, strict=True) if v is None]
            for value in values:
                if value is None:
                    continue
                try:
                    counts = orjson.loads(value)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(counts, dict):
                    for url, n in counts.items():
                        if isinstance(n, int) and n > 0:
                            totals[url] = totals.get(url, 0) + n
            if gone:  # a live gateway re-adds itself on its next flush, so pruning can only be briefly wrong
                await self._client.srem(self.registry_key, *gone)
                others = [m for m in others if m not in gone]
        self._remote = totals
        self._peers = others
        self.counters.polls += 1

    # -- capacity signal -----------------------------------------------------------------------------------------

    async def exchange_capacity(self, share: bytes, ttl_s: float) -> list[tuple[str, bytes]] | None:
        """One pipeline: SET this gateway's share with a TTL (a gateway that dies stops counting within `ttl_s`;
        one that stops withdraws it at once) and MGET the other live gateways'. Never raises for Redis: an
        unreachable Redis (or one refusing the commands) answers None, and the caller sizes from its own demand."""
        if not self.available or self._stopping:
            return None
        peers = self._peers
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self.capacity_key, share, px=max(1, int(ttl_s * 1000)))
        if peers:
            pipe.mget([self._capacity_prefix + p for p in peers])
        epoch = self._epoch
        try:
            replies = await pipe.execute()
        except _CONNECTION_ERRORS as exc:
            self._lost(exc, epoch)
            return None
        except RedisError as exc:
            self.counters.errors += 1
            self._log_once(f"capacity:{type(exc).__name__}", "shared state: publishing the demand share failed: %s",
                           exc)
            return None
        self.counters.capacity_exchanges += 1
        out = [(self.gateway_id, share)]
        if peers:
            for peer, blob in zip(peers, replies[1], strict=True):
                if blob is not None:  # None: expired (the gateway died) or not published yet (it just started)
                    out.append((peer.decode(errors="replace"), bytes(blob)))
            self.counters.capacity_shares_read += len(out) - 1
        return out


def build_shared_state(url: str | None, apply_remote: ApplyRemote, local_in_flight: LocalInFlight,
                       *, model: str | None = None, sessions: SessionSync | None = None) -> SharedState:
    """`state:` from the config: unset (or "memory") → this process only; redis://, rediss://, unix:// → Redis,
    with keys under "m3gate:<model>:" so that gateways of different models can share one Redis. `sessions`: the
    session store whose answers are shared too (it must be built with `shared=True` only when this returns a
    RedisState, or its outbox fills for nobody: bounded, but wasted)."""
    if not url or url == "memory":
        return LocalState()
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"state: unsupported URL scheme {scheme!r}; use redis://host:port/db (or leave it unset)")
    return RedisState(url, apply_remote, local_in_flight, key_prefix=f"m3gate:{model or 'default'}:",
                      sessions=sessions)
