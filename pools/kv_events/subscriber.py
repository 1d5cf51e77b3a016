"""Following one KV-event publisher (a replica, or one data-parallel rank of it) into pools.exact_index.

vLLM (`distributed/kv_events.py`) publishes on a ZMQ PUB socket, per engine step that changed its prefix cache, a
multipart `[topic, seq (8 bytes big-endian), payload]`, the payload a msgpack `KVEventBatch` (decoding.py). It keeps
the last `buffer_steps` batches and replays them on a ROUTER socket: a DEALER sends `[b"", start_seq]` and receives
`[b"", topic, seq, payload]` per buffered batch (0.32; older versions `[b"", seq, payload]`), then the end marker
`[b"", b"", seq=-1, b""]`.

One `SourceSubscriber` task per source:

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
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pools.exact_index import ExactIndex
from pools.kv_events.decoding import BlockRemoved, BlockStored, KvEventDecodeError, counts_for_routing, decode_batch
from pools.kv_events.sources import KvEventSource

__all__ = ["Clock", "SourceStats", "SourceSubscriber", "SubscriberSettings"]

log = logging.getLogger("m3gate.kv_events")

END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True): the replay's end marker
Clock = Callable[[], float]


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
    """Follows one publisher into `index` (see the module docstring)."""

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
                if counts_for_routing(event.medium, event.group_idx):
                    index.stored(key, event.block_hashes)
                    stats.stored += len(event.block_hashes)
                    if event.token_ids and self.settings.first_block_hash is not None:
                        self._check_hash(event, now)
                else:
                    stats.ignored += 1
            elif isinstance(event, BlockRemoved):
                if counts_for_routing(event.medium, event.group_idx):
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
        sampled_out = stats.roots_seen > self.settings.check_first and stats.roots_seen % self.settings.check_every
        if not distrusted and sampled_out:
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
