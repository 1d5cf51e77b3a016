"""KV-cache events from vLLM replicas: decode them, follow each publisher's sequence, keep pools.exact_index current.

vLLM (`distributed/kv_events.py`) publishes on a ZMQ PUB socket, per engine step that changed its prefix cache, a
multipart `[topic, seq (8 bytes big-endian), payload]`, the payload a msgpack `KVEventBatch`. It keeps the last
`buffer_steps` batches and replays them on a ROUTER socket: a DEALER sends `[b"", start_seq]` and receives
`[b"", topic, seq, payload]` per buffered batch (0.32; older versions `[b"", seq, payload]`), then the end marker
`[b"", b"", seq=-1, b""]`.

Per event source (a replica, or one data-parallel rank of it) one `SourceSubscriber` task:

- connects a SUB socket (pyzmq asyncio) and watches the connection through a socket monitor. Each time the
  connection is (re)established it *resyncs*: empties the source's blocks and replays the whole buffer, so that a
  restarted replica (new process, empty cache, seq from 0) or a reconnect after lost messages never leaves phantom
  blocks. While the replay runs, live batches wait in the SUB socket's queue (bounded by its high-water mark);
  afterwards the ones already replayed are skipped by seq.
- applies live batches in sequence. A jump in seq is a gap: the missing batches are replayed; when the buffer no
  longer has them the source is resynced. A seq that goes back (outside a replay) is a publisher restart: resync.
- when history is incomplete (replay failed or timed out, no replay endpoint, buffer already wrapped, an
  undecodable batch), the blocks known may miss some the replica holds or hold some it dropped: the source is
  emptied and marked stale for `stale_after_failure_s` (routing falls back to the approximate index meanwhile), then
  rebuilt from the events that follow. Blocks stored before a wrapped buffer and only hit since are not learnt until
  stored again (vLLM reports hits only with kv_cache_report_mode=full).

`decode_batch` reads both msgpack layouts vLLM has used: events as maps tagged `"type"` (0.32) and as arrays whose
first item is the tag (≈0.11 and before), the batch as an array `[ts, events, dp_rank?]` or a map. Block hashes may
be ints (the default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) or raw digests; both become the low 64 bits. Only the
GPU tier (medium None or "GPU") and KV-cache group 0 feed the index: a CPU-offload copy or a sliding-window group's
blocks do not make a prefix hit by themselves.

`KvEventHub` owns the tasks for a set of replicas: endpoints from config (`tcp://*:5557` as given to vLLM; `*`,
0.0.0.0 and `::` become the replica's host; DP rank r on port + r) or discovered from the replica's
`GET /kv_event_sources`. `sync()` after each config reload adds and removes replicas; a removed one's tasks stop and
its blocks are freed. The events carry prompt token ids, which are decoded and dropped at once, never stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgpack
import orjson
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pools.exact_index import ExactIndex

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KvEventDecodeError",
    "KvEventHub",
    "KvEventSource",
    "PreciseCollector",
    "PrecisePool",
    "ReplicaEvents",
    "SourceStats",
    "SourceSubscriber",
    "SubscriberSettings",
    "decode_batch",
    "resolve_endpoint",
    "sources_from_config",
    "sources_from_discovery",
]

log = logging.getLogger("m3gate.kv_events")

END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True): the replay's end marker
_LOW64 = (1 << 64) - 1
Clock = Callable[[], float]


# ---------------------------------------------------------------------------------------------------------------
# Decoding


class KvEventDecodeError(ValueError):
    """A payload that is not a KVEventBatch in any known layout."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None = None
    block_size: int | None = None
    medium: str | None = None
    group_idx: int | None = None
    token_ids: tuple[int, ...] = ()  # the stored blocks' tokens, concatenated (what the hash check reads)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    skipped: int = 0  # events of unknown types (newer vLLM): ignored, counted


def _hash(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _LOW64
    if isinstance(value, (bytes, bytearray)) and value:
        return int.from_bytes(bytes(value[-8:]), "big")
    raise KvEventDecodeError(f"a block hash must be an int or bytes, not {type(value).__name__}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise KvEventDecodeError("block_hashes must be an array")
    return tuple(_hash(v) for v in value)


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# The array layout's field order per tag (msgspec array_like: the tag first, then fields in declaration order).
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _ARRAY_FIELDS.get(tag)
        if names is None:
            return None
        fields = dict(zip(names, raw[1:]))
    else:
        raise KvEventDecodeError(f"an event must be a map or a tagged array, not {type(raw).__name__}")
    if tag == "BlockStored":
        parent = fields.get("parent_block_hash")
        tokens = fields.get("token_ids")
        return BlockStored(
            block_hashes=_hashes(fields.get("block_hashes")),
            parent_block_hash=None if parent is None else _hash(parent),
            block_size=_opt_int(fields.get("block_size")),
            medium=_opt_str(fields.get("medium")),
            group_idx=_opt_int(fields.get("group_idx")),
            token_ids=tuple(tokens) if parent is None and isinstance(tokens, list) else (),  # only roots are checked
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields.get("block_hashes")),
            medium=_opt_str(fields.get("medium")),
            group_idx=_opt_int(fields.get("group_idx")),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(medium=_opt_str(fields.get("medium")))
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """A KVEventBatch from its msgpack payload, in either layout; raises KvEventDecodeError."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types on bad input
        raise KvEventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise KvEventDecodeError("a batch must be [ts, events, rank?] or a map")
    if not isinstance(events, (list, tuple)):
        raise KvEventDecodeError("the batch's events must be an array")
    decoded: list[Event] = []
    skipped = 0
    for item in events:
        event = _event(item)
        if event is None:
            skipped += 1
        else:
            decoded.append(event)
    return EventBatch(float(ts) if isinstance(ts, (int, float)) else 0.0, tuple(decoded), _opt_int(rank), skipped)


def _counts_for_routing(medium: str | None, group_idx: int | None) -> bool:
    return (medium is None or medium == "GPU") and not group_idx


# ---------------------------------------------------------------------------------------------------------------
# Endpoints


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """One publisher: the index key it feeds, the replica it belongs to, where to connect."""

    key: str
    replica: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def resolve_endpoint(endpoint: str, replica_url: str, rank: int = 0) -> str:
    """vLLM's endpoint as seen from the gateway: wildcard hosts become the replica's host; DP rank r is port + r
    (vLLM's offset_endpoint_port); a port of 0 was resolved by vLLM, so only discovery can say it."""
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    if endpoint.startswith("tcp://"):
        address = endpoint[len("tcp://"):]
        base, _, port = address.rpartition(":")
        if base in ("*", "0.0.0.0", "[::]", "::", "") or base.startswith("*"):
            base = host
        if rank and port.isdigit() and int(port):
            port = str(int(port) + rank)
        return f"tcp://{base}:{port}"
    if rank and endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    return endpoint


def source_key(replica: str, rank: int) -> str:
    return replica if rank == 0 else f"{replica}#dp{rank}"


@dataclass(frozen=True, slots=True)
class ReplicaEvents:
    """What the hub should subscribe to for one replica (built from the pool's `precise` config)."""

    replica: str
    pool: str = ""
    kv_blocks: int | None = None
    endpoint: str | None = None  # as in vLLM's --kv-events-config; None: GET /kv_event_sources
    replay_endpoint: str | None = None
    topic: str = ""
    data_parallel_size: int = 1
    headers: tuple[tuple[str, str], ...] = ()


def sources_from_config(target: ReplicaEvents) -> list[KvEventSource]:
    assert target.endpoint is not None
    return [
        KvEventSource(
            key=source_key(target.replica, rank),
            replica=target.replica,
            endpoint=resolve_endpoint(target.endpoint, target.replica, rank),
            replay_endpoint=resolve_endpoint(target.replay_endpoint, target.replica, rank)
            if target.replay_endpoint else None,
            topic=target.topic,
        )
        for rank in range(max(1, target.data_parallel_size))
    ]


def sources_from_discovery(replica: str, body: Any) -> list[KvEventSource]:
    """Sources from a `/kv_event_sources` answer: {"0": {"endpoint": ..., "replay_endpoint": ..., "topic": ...}}."""
    if not isinstance(body, dict):
        return []
    out = []
    for rank_key, cfg in sorted(body.items(), key=lambda kv: str(kv[0])):
        if not isinstance(cfg, dict) or not cfg.get("enable_kv_cache_events", True):
            continue
        if cfg.get("publisher", "zmq") != "zmq" or not isinstance(cfg.get("endpoint"), str):
            continue
        try:
            rank = int(rank_key)
        except (TypeError, ValueError):
            rank = 0
        replay = cfg.get("replay_endpoint")
        # /kv_event_sources reports each rank's own endpoints (already offset): only wildcards are replaced
        out.append(KvEventSource(
            key=source_key(replica, rank), replica=replica, endpoint=resolve_endpoint(cfg["endpoint"], replica),
            replay_endpoint=resolve_endpoint(replay, replica) if isinstance(replay, str) and replay else None,
            topic=str(cfg.get("topic") or ""),
        ))
    return out


# ---------------------------------------------------------------------------------------------------------------
# One source


@dataclass(frozen=True, slots=True)
class SubscriberSettings:
    replay_timeout_s: float = 5.0  # longest silence of the replay socket (a full buffer takes a while to stream)
    replay_max_s: float = 120.0  # longest replay in all
    stale_after_failure_s: float = 30.0  # incomplete history: approximate routing for this long
    rcvhwm: int = 10_000  # live batches queued while a replay runs (beyond: dropped, then replayed as a gap)
    max_replay_batches: int = 200_000
    discovery_retry_s: float = 5.0
    rediscover_after_s: float = 30.0  # discovered sources unreachable this long: ask /kv_event_sources again
    poll_ms: int = 1000
    # The gateway's hash of a prompt's first block from its token ids (None: no check). BlockStored events carry
    # their blocks' tokens: hashing the first block of a prompt as the gateway would and comparing it with the hash
    # the replica published catches a replica whose hashes the gateway can never reproduce (another PYTHONHASHSEED,
    # hash algorithm or block size): its fresh-looking events would otherwise make every request look cold there.
    first_block_hash: Callable[[Sequence[int]], int | None] | None = None
    check_every: int = 16  # after the first `check_first` roots, one root event in this many is checked
    check_first: int = 8


@dataclass(slots=True)
class SourceStats:
    """Counters per source, exported on /metrics."""

    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    ignored: int = 0  # events for another tier or KV group, or of an unknown type
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    resyncs: int = 0
    restarts: int = 0
    decode_errors: int = 0
    malformed: int = 0
    connected: bool = False
    down_since: float | None = None  # not connected since (None while connected)
    last_seq: int | None = None
    hash_checks: int = 0  # first blocks the gateway hashed itself and compared with the published hash
    hash_mismatches: int = 0
    roots_seen: int = 0  # BlockStored events starting a prompt (no parent), the ones that can be checked
    mismatch_streak: int = 0
    match_streak: int = 0


_MISMATCH_STREAK = 3


class SourceSubscriber:
    """Follows one publisher into `index` (see the module docstring for the protocol)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        source: KvEventSource,
        index: ExactIndex,
        clock: Clock = time.monotonic,
        settings: SubscriberSettings | None = None,
        stats: SourceStats | None = None,
    ) -> None:
        self.ctx = ctx
        self.source = source
        self.index = index
        self.clock = clock
        self.settings = settings or SubscriberSettings()
        self.stats = stats or SourceStats()
        self.last: int | None = None  # last seq applied; None: the next live batch starts the sequence
        self.synced = False  # a resync finished since the last (re)connect
        self._after_replay = False  # live batches up to `last` are duplicates of replayed ones

    async def run(self) -> None:
        key = self.source.key
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.settings.rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        self.index.set_live(key, False, "connecting")
        self.stats.down_since = self.clock()
        try:
            sub.connect(self.source.endpoint)
            while True:
                ready = dict(await poller.poll(self.settings.poll_ms))
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        self.stats.connected = True
                        self.stats.down_since = None
                        await self.resync()
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        self.stats.connected = False
                        self.stats.down_since = self.clock()
                        self.synced = False
                        self.index.set_live(key, False, "disconnected")
                if sub in ready:
                    await self.on_live(await sub.recv_multipart())
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self.index.set_live(key, False, "stopped")

    # -- the sequence -------------------------------------------------------------------------------------------

    async def on_live(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1
            return
        if not self.synced:
            return  # connected, resync not done yet: the replay covers this batch
        seq = int.from_bytes(frames[1], "big")
        last = self.last
        if last is None or seq == last + 1:
            self._after_replay = False
            self.apply(seq, frames[2])
        elif seq <= last:
            if not self._after_replay:  # a new publisher counting from 0 again
                self.stats.restarts += 1
                await self._rebuild(seq, frames[2])
        else:
            self.stats.gaps += 1
            if self.source.replay_endpoint is None or await self.replay(last + 1, full=False) != "complete":
                await self._rebuild(seq, frames[2])

    async def _rebuild(self, seq: int, payload: bytes) -> None:
        """Lost history: resync; without a replay socket this batch is the new start of the sequence."""
        await self.resync()
        if self.source.replay_endpoint is None:
            self.apply(seq, payload)

    def apply(self, seq: int, payload: bytes) -> bool:
        """Apply one batch to the index (in sequence). Returns whether it emptied the cache (AllBlocksCleared): what
        came before no longer matters."""
        key = self.source.key
        index = self.index
        stats = self.stats
        self.last = stats.last_seq = seq
        now = self.clock()
        try:
            batch = decode_batch(payload)
        except KvEventDecodeError as exc:
            stats.decode_errors += 1
            log.warning("KV events from %s: undecodable batch %d (%s); index rebuilt from later events", key, seq, exc)
            index.cleared(key)
            index.mark_stale(key, "decode_error", now + self.settings.stale_after_failure_s)
            return False
        stats.batches += 1
        emptied = False
        stats.ignored += batch.skipped
        for event in batch.events:
            if isinstance(event, BlockStored):
                if _counts_for_routing(event.medium, event.group_idx):
                    index.stored(key, event.block_hashes)
                    stats.stored += len(event.block_hashes)
                    if event.token_ids and self.settings.first_block_hash is not None:
                        self._check_hash(event, now)
                else:
                    stats.ignored += 1
            elif isinstance(event, BlockRemoved):
                if _counts_for_routing(event.medium, event.group_idx):
                    index.removed(key, event.block_hashes)
                    stats.removed += len(event.block_hashes)
                else:
                    stats.ignored += 1
            elif event.medium is None or event.medium == "GPU":
                index.cleared(key)
                stats.cleared += 1
                emptied = True
        index.heard(key, now)
        return emptied

    def _check_hash(self, event: BlockStored, now: float) -> None:
        """Sampled: hash the first block of a prompt from its published tokens and compare. Three mismatches in a
        row with none matching since distrust the source (scored approximately, fallback reason `hash_mismatch`,
        one loud log line); while distrusted every root is checked, and three matches in a row trust it again."""
        stats = self.stats
        stats.roots_seen += 1
        distrusted = stats.mismatch_streak >= _MISMATCH_STREAK
        if not distrusted and stats.roots_seen > self.settings.check_first and stats.roots_seen % self.settings.check_every:
            return
        assert self.settings.first_block_hash is not None
        expected = self.settings.first_block_hash(event.token_ids)
        if expected is None:
            return
        stats.hash_checks += 1
        if expected == event.block_hashes[0]:
            stats.match_streak += 1
            if distrusted and stats.match_streak >= _MISMATCH_STREAK:
                stats.mismatch_streak = 0
                self.index.clear_stale(self.source.key, "hash_mismatch")
                log.warning("KV events from %s: block hashes match the gateway's again; exact routing resumed",
                            self.source.key)
            elif not distrusted:
                stats.mismatch_streak = 0
            return
        stats.hash_mismatches += 1
        stats.match_streak = 0
        stats.mismatch_streak += 1
        if stats.mismatch_streak == _MISMATCH_STREAK:
            log.error("KV events from %s: the replica's block hashes do not match the gateway's for the same tokens "
                      "(%d of %d checks). Likely causes: the replica's PYTHONHASHSEED differs from the pool's "
                      "precise.hash_seed, or its --prefix-caching-hash-algo / --block-size differ from the pool "
                      "config. Routing to it approximately until they match.", self.source.key,
                      stats.hash_mismatches, stats.hash_checks)
        if stats.mismatch_streak >= _MISMATCH_STREAK:
            self.index.mark_stale(self.source.key, "hash_mismatch", float("inf"))

    async def resync(self) -> None:
        """Rebuild the source from the replay buffer (or, without one, from the next live batch on)."""
        key = self.source.key
        self.stats.resyncs += 1
        self.index.set_live(key, False, "syncing")
        self.synced = False
        outcome = "no_replay" if self.source.replay_endpoint is None else await self.replay(0, full=True)
        if outcome != "complete":
            if outcome != "partial_history":  # nothing usable came back: start from the next live batch
                self.index.cleared(key)
                self.last = None
            self.index.mark_stale(key, outcome, self.clock() + self.settings.stale_after_failure_s)
        self.synced = True
        self.index.set_live(key, True)

    async def replay(self, start: int, *, full: bool) -> str:
        """Ask the replay socket for batches from `start` and apply them. `full`: the source is emptied first and the
        buffer's whole content defines it. Returns "complete", "partial_history" (full only: the buffer had wrapped,
        what it held was applied) or "replay_failed" (timeout, error, or a gap the buffer no longer holds)."""
        assert self.source.replay_endpoint is not None
        stats = self.stats
        stats.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        began = self.clock()
        deadline = began + self.settings.replay_timeout_s
        if full:
            self.index.cleared(self.source.key)
            self.last = None
        complete = True
        count = 0
        try:
            dealer.connect(self.source.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                remaining = deadline - self.clock()
                if remaining <= 0 or not await dealer.poll(int(remaining * 1000) + 1):
                    stats.replay_failures += 1
                    return "replay_failed"
                frames = await dealer.recv_multipart()
                deadline = min(self.clock() + self.settings.replay_timeout_s, began + self.settings.replay_max_s)
                if len(frames) == 4:
                    seq_bytes, payload = frames[2], frames[3]
                elif len(frames) == 3:
                    seq_bytes, payload = frames[1], frames[2]
                else:
                    stats.malformed += 1
                    continue
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if self.last is not None and seq <= self.last:
                    continue
                expected = start if self.last is None else self.last + 1
                if seq != expected:
                    if not full:
                        stats.replay_failures += 1
                        return "replay_failed"  # the buffer no longer holds the gap: the caller resyncs
                    complete = False  # history before the buffer's window is unknown
                if self.apply(seq, payload) and full:
                    complete = True  # the cache was emptied here: nothing before it matters
                count += 1
                if count >= self.settings.max_replay_batches:
                    stats.replay_failures += 1
                    return "replay_failed"
        except zmq.ZMQError:
            stats.replay_failures += 1
            return "replay_failed"
        finally:
            dealer.close(linger=0)
        self._after_replay = True
        return "complete" if complete else "partial_history"


# ---------------------------------------------------------------------------------------------------------------
# Many replicas


@dataclass
class _Feed:
    target: ReplicaEvents
    task: asyncio.Task[None] | None = None
    sources: list[KvEventSource] = field(default_factory=list)
    stats: dict[str, SourceStats] = field(default_factory=dict)


class KvEventHub:
    """Subscriptions for every replica of the pools that route precisely; `sync()` them to the current set."""

    def __init__(
        self, index: ExactIndex, clock: Clock | None = None, settings: SubscriberSettings | None = None
    ) -> None:
        self.index = index
        self.clock = clock or index.clock
        self.settings = settings or SubscriberSettings()
        self._feeds: dict[str, _Feed] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._session: aiohttp.ClientSession | None = None
        self._started = False

    async def start(self, session: aiohttp.ClientSession | None = None) -> None:
        """Start the tasks (needs a running loop); `session` serves /kv_event_sources discovery."""
        self._session = session
        self._ctx = zmq.asyncio.Context()
        self._started = True
        for feed in self._feeds.values():
            self._launch(feed)

    async def stop(self) -> None:
        self._started = False
        tasks = [f.task for f in self._feeds.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for feed in self._feeds.values():
            feed.task = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def sync(self, targets: Mapping[str, ReplicaEvents]) -> None:
        """Subscribe to exactly these replicas; a changed target restarts its feed, a removed one is freed."""
        for replica in [r for r in self._feeds if r not in targets]:
            self._drop(replica)
        for replica, target in targets.items():
            feed = self._feeds.get(replica)
            if feed is not None and replace(feed.target, kv_blocks=target.kv_blocks) != target:
                self._drop(replica)
                feed = None
            if feed is None:
                feed = self._feeds[replica] = _Feed(target)
                if self._started:
                    self._launch(feed)
            else:
                feed.target = target
                for source in feed.sources:
                    self.index.add_source(source.key, replica, target.kv_blocks)

    def _drop(self, replica: str) -> None:
        feed = self._feeds.pop(replica)
        if feed.task is not None:
            feed.task.cancel()
        for source in feed.sources:
            self.index.remove_source(source.key)

    def _launch(self, feed: _Feed) -> None:
        feed.task = asyncio.get_running_loop().create_task(
            self._run_feed(feed), name=f"m3gate-kv-events {feed.target.replica}"
        )

    async def _run_feed(self, feed: _Feed) -> None:
        """Subscribe to the replica's sources; discovered ones are looked up again when they stay unreachable (a
        replica restarted with `tcp://*:0` publishes on new ports)."""
        target = feed.target
        while True:
            sources = sources_from_config(target) if target.endpoint else await self._discover(target)
            for old in feed.sources:
                if old not in sources:
                    self.index.remove_source(old.key)
            feed.sources = sources
            for source in sources:
                self.index.add_source(source.key, target.replica, target.kv_blocks)
                feed.stats[source.key] = SourceStats()
            assert self._ctx is not None
            tasks = [asyncio.ensure_future(
                SourceSubscriber(self._ctx, s, self.index, self.clock, self.settings, feed.stats[s.key]).run())
                for s in sources]
            log.info("KV events for %s: %s", target.replica, ", ".join(s.endpoint for s in sources))
            try:
                if target.endpoint:
                    await asyncio.gather(*tasks)
                    return
                while not self._unreachable(feed):
                    await asyncio.sleep(self.settings.rediscover_after_s / 4)
                log.warning("KV events for %s unreachable for %.0fs: asking /kv_event_sources again",
                            target.replica, self.settings.rediscover_after_s)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _unreachable(self, feed: _Feed) -> bool:
        now = self.clock()
        downs = [feed.stats[s.key].down_since for s in feed.sources]
        return bool(downs) and all(d is not None and now - d > self.settings.rediscover_after_s for d in downs)

    async def _discover(self, target: ReplicaEvents) -> list[KvEventSource]:
        """GET /kv_event_sources until it names a zmq publisher (the replica may still be starting)."""
        timeout = aiohttp.ClientTimeout(total=5)
        while True:
            if self._session is not None:
                try:
                    async with self._session.get(
                        target.replica + "/kv_event_sources", headers=dict(target.headers), timeout=timeout
                    ) as resp:
                        if resp.status == 200:
                            sources = sources_from_discovery(target.replica, orjson.loads(await resp.read()))
                            if sources:
                                return sources
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, orjson.JSONDecodeError):
                    pass
            await asyncio.sleep(self.settings.discovery_retry_s)

    # -- introspection ------------------------------------------------------------------------------------------

    def replicas(self) -> list[str]:
        return list(self._feeds)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per source: endpoint, counters, and the index's view (blocks, freshness)."""
        now = self.clock()
        out: dict[str, dict[str, Any]] = {}
        for replica, feed in self._feeds.items():
            for source in feed.sources:
                s = feed.stats.get(source.key) or SourceStats()
                out[source.key] = {
                    "replica": replica, "pool": feed.target.pool, "endpoint": source.endpoint,
                    "blocks": self.index.size(replica), "stale_reason": self.index.stale_reason(replica, now),
                    **{k: getattr(s, k) for k in SourceStats.__dataclass_fields__},
                }
        return out

    def iter_sources(self) -> Iterator[tuple[str, str, SourceStats, ExactIndex]]:
        """(pool, source key, stats, index) for every source (the metrics collector)."""
        for feed in self._feeds.values():
            for source in feed.sources:
                yield feed.target.pool, source.key, feed.stats.get(source.key) or SourceStats(), self.index


# ---------------------------------------------------------------------------------------------------------------
# Metrics


class PreciseCollector:
    """Prometheus families for precise routing, read at scrape time (nothing on the hot path):
    per source the event stream's counters and the index's size and freshness; per pool how replicas were scored."""

    def __init__(self, hub: Any, matchers: Callable[[], Mapping[str, Any]],
                 hashers: Callable[[], Mapping[str, Any]]) -> None:
        self._hub = hub  # a KvEventHub, or anything with clock() and iter_sources() the same way
        self._matchers = matchers  # pool → HybridMatcher
        self._hashers = hashers  # pool → PromptHasher

    def describe(self) -> list[Any]:
        return []  # collected lazily (the set of families does not change, their label sets do)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

        labels = ["pool", "endpoint"]
        batches = CounterMetricFamily("m3gate_kv_event_batches", "KV event batches applied, per replica event source.",
                                      labels=labels)
        events = CounterMetricFamily("m3gate_kv_events", "KV events applied (blocks for stored/removed).",
                                     labels=[*labels, "type"])
        gaps = CounterMetricFamily("m3gate_kv_event_gaps", "Sequence gaps seen on the live stream.", labels=labels)
        replays = CounterMetricFamily("m3gate_kv_event_replays", "Replay requests, by outcome.",
                                      labels=[*labels, "outcome"])
        resyncs = CounterMetricFamily("m3gate_kv_event_resyncs", "Full rebuilds from the replay buffer (connects, "
                                      "restarts, unrecoverable gaps).", labels=labels)
        errors = CounterMetricFamily("m3gate_kv_event_decode_errors", "Undecodable or malformed batches.",
                                     labels=labels)
        blocks = GaugeMetricFamily("m3gate_exact_index_blocks", "Blocks the replica holds per its KV events.",
                                   labels=labels)
        fresh = GaugeMetricFamily("m3gate_exact_index_fresh", "1 when the replica's exact view is used for routing "
                                  "(synced, live, not silent, hashes matching the gateway's).", labels=labels)
        checks = CounterMetricFamily("m3gate_kv_event_hash_checks", "First blocks the gateway hashed from a "
                                     "BlockStored event's tokens, by whether its hash matched the replica's.",
                                     labels=[*labels, "result"])
        now = self._hub.clock()
        seen: set[str] = set()
        for pool, key, s, index in self._hub.iter_sources():
            lv = [pool, key]
            batches.add_metric(lv, s.batches)
            for kind, value in (("stored", s.stored), ("removed", s.removed), ("cleared", s.cleared),
                                ("ignored", s.ignored)):
                events.add_metric([*lv, kind], value)
            gaps.add_metric(lv, s.gaps)
            replays.add_metric([*lv, "ok"], s.replays - s.replay_failures)
            replays.add_metric([*lv, "failed"], s.replay_failures)
            resyncs.add_metric(lv, s.resyncs)
            errors.add_metric(lv, s.decode_errors + s.malformed)
            checks.add_metric([*lv, "match"], s.hash_checks - s.hash_mismatches)
            checks.add_metric([*lv, "mismatch"], s.hash_mismatches)
            replica = key.split("#dp", 1)[0]
            if replica not in seen:
                seen.add(replica)
                blocks.add_metric([pool, replica], index.size(replica))
                fresh.add_metric([pool, replica], float(index.fresh(replica, now)))
        yield from (batches, events, gaps, replays, resyncs, errors, blocks, fresh, checks)

        scored = CounterMetricFamily("m3gate_precise_replica_scorings", "Replica scorings by where the matched "
                                     "prefix came from (exact: KV events; approx: estimate).",
                                     labels=["pool", "source"])
        fallbacks = CounterMetricFamily("m3gate_precise_fallbacks", "Replica scorings that fell back to the "
                                        "estimate, by why the exact view was not used.", labels=["pool", "reason"])
        requests = CounterMetricFamily("m3gate_precise_requests", "Requests routed in precise pools, by whether the "
                                       "gateway computed their exact block hashes.", labels=["pool", "hashes"])
        for pool, matcher in self._matchers().items():
            c = matcher.counters
            scored.add_metric([pool, "exact"], c.replicas_exact)
            scored.add_metric([pool, "approx"], c.replicas_approx)
            for reason, value in c.stale_fallbacks.items():
                fallbacks.add_metric([pool, reason], value)
        for pool, hasher in self._hashers().items():
            requests.add_metric([pool, "exact"], hasher.computed)
            requests.add_metric([pool, "none"], hasher.skipped)
        yield from (scored, fallbacks, requests)


# ---------------------------------------------------------------------------------------------------------------
# One pool's precise routing, as the gateway holds it


def first_block_hasher(settings: Any) -> Callable[[Sequence[int]], int | None]:
    """The gateway's hash of the first block of `token_ids` under the pool's hash settings (None if shorter)."""
    from policies.vllm_hash import block_hashes

    def first(token_ids: Sequence[int]) -> int | None:
        size = settings.block_size
        if len(token_ids) < size:
            return None
        try:
            found = block_hashes(token_ids[:size], size, algo=settings.algo, seed=settings.seed, max_blocks=1)
        except ValueError:  # an algorithm the gateway cannot reproduce without a seed
            return None
        return found[0] if found else None

    return first


class PrecisePool:
    """Everything precise routing needs for one pool: its exact index, the event subscriptions that feed it, the
    hybrid matcher its PrefixAffinity policy reads, and the prompt hasher that computes requests' exact hashes.

    Built from the pool's config (`policies.config.PreciseConfig`, its block_size and launch spec); rebuilt whole when
    any of that changes. The approximate index is the gateway's, shared with approximate pools."""

    def __init__(self, pool: Any, model: str, approx: Any, clock: Clock = time.monotonic) -> None:
        from pools.exact_index import HybridMatcher
        from pools.tokenizer import HashSettings, LocalTokenizer

        cfg = pool.precise
        assert cfg is not None and cfg.enabled
        self.name: str = pool.name
        self.config = cfg
        self.model = model
        self.endpoint, self.replay_endpoint, self.ranks = self.endpoints_for(pool)
        self.identity = self.identity_for(pool, model)
        self.index = ExactIndex(clock, silent_after_s=cfg.silent_after_s, pending_ttl_s=cfg.pending_ttl_s)
        self.hash_settings = HashSettings(block_size=pool.block_size, algo=cfg.hash_algo, seed=cfg.hash_seed)
        self.hub = KvEventHub(self.index, clock, SubscriberSettings(
            replay_timeout_s=cfg.replay_timeout_s, stale_after_failure_s=cfg.stale_after_failure_s,
            first_block_hash=first_block_hasher(self.hash_settings)))
        self.matcher = HybridMatcher(approx, self.index, clock)
        self._local = LocalTokenizer(cfg.model_dir, cfg.max_tokenize_chars) if cfg.tokenizer == "local" else None
        self.hasher: Any = None  # PromptHasher, once started (the replica tokenizer needs the HTTP session)
        if self._local is not None:
            self._make_hasher(self._local)

    @staticmethod
    def endpoints_for(pool: Any) -> tuple[str | None, str | None, int]:
        """(endpoint, replay endpoint, DP ranks): the config's, else what `launch` renders, else discovery (None)."""
        cfg, launch = pool.precise, pool.launch
        endpoint, replay, ranks = cfg.endpoint, cfg.replay_endpoint, cfg.data_parallel_size
        if endpoint is None and launch is not None and launch.kv_events:
            endpoint = f"tcp://*:{launch.kv_events_port}"
            replay = replay or f"tcp://*:{launch.kv_events_replay_port}"
        if ranks is None:
            ranks = launch.data_parallel_size if launch is not None else 1
        return endpoint, replay, ranks

    @staticmethod
    def identity_for(pool: Any, model: str) -> tuple[Any, ...]:
        """What, when changed by a reload, makes the pool's precise state start over."""
        return (pool.precise, pool.block_size, *PrecisePool.endpoints_for(pool), model)

    def _make_hasher(self, source: Any) -> None:
        from pools.tokenizer import PromptHasher

        self.hasher = PromptHasher(source, self.hash_settings)

    def targets(self, replicas: Sequence[Any], headers: Mapping[str, str]) -> dict[str, ReplicaEvents]:
        """What to subscribe to for these replicas (pools.replicas.Replica objects)."""
        return {
            r.url: ReplicaEvents(
                replica=r.url, pool=self.name, kv_blocks=r.kv_blocks, endpoint=self.endpoint,
                replay_endpoint=self.replay_endpoint, topic=self.config.topic, data_parallel_size=self.ranks,
                headers=tuple(sorted(headers.items())),
            )
            for r in replicas
        }

    async def start(self, session: aiohttp.ClientSession, headers: Mapping[str, str] | None = None) -> None:
        if self.hasher is None:
            from pools.tokenizer import ReplicaTokenizer

            self._make_hasher(ReplicaTokenizer(session, self.model, headers, self.config.tokenize_timeout_s))
        await self.hub.start(session)

    async def stop(self) -> None:
        await self.hub.stop()
        if self.hasher is not None:
            self.hasher.close()

    async def exact_hashes(self, payload: bytes, api: str, replica_url: str | None) -> tuple[int, ...]:
        if self.hasher is None:
            return ()
        return await self.hasher.hashes(payload, api, replica_url)
