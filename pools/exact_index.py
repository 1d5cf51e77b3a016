"""Which vLLM blocks each replica holds *now*, from its own KV events, and the hybrid matcher routing reads.

`ExactIndex` is fed by pools/kv_events/: BlockStored adds hashes, BlockRemoved drops them, AllBlocksCleared empties
a replica. Unlike the approximate index (pools/prefix_index.py, what the gateway *sent*), it sees evictions, blocks
filled by other gateways or clients, and restarts. It is keyed by event *source*: one per replica, or one per data-
parallel rank (each rank has its own cache); queries answer per replica, the best rank counting.

Each source is bounded by its replica's KV blocks (vLLM cannot hold more): when lost BlockRemoved events would let a
set grow past that, its oldest blocks go. Removing a replica frees everything it had.

A replica's exact view is *fresh* when its stream is synced and live, not marked stale (a gap that replay could not
close, a broken or restarted stream: for `stale_until`), and not silent: after the gateway sent it a request with
blocks it did not hold, some event batch must arrive within `silent_after_s`, else its publisher is presumed lost.
Routing uses exact matches for fresh replicas and the approximate index for the others (`HybridMatcher`).

Blocks the gateway has just sent to a replica are not in its events yet (vLLM publishes them once computed, after the
queue and the prefill): they are kept as *pending* for `pending_ttl_s`, so a burst sharing a new prefix still meets
on one replica. A pending block leaves when its BlockStored or BlockRemoved arrives, or when its time is up.

Plain, synchronous, in memory, driven from the gateway's event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from policies.replica_choice import PrefixMatch, RoutingRequest
from pools.block_lru import BlockLRU, BlockSets
from pools.prefix_index import DEFAULT_BLOCKS, PrefixIndex

__all__ = ["ExactIndex", "HybridMatcher", "MatchCounters", "DEFAULT_BLOCKS"]

Clock = Callable[[], float]


@dataclass(slots=True)
class _Source:
    replica: str
    lru: BlockLRU[None]  # its blocks, oldest first (pools/block_lru.py)
    live: bool = False  # synced with the publisher (subscriber sets it)
    down_reason: str = "not_synced"  # why it is not live
    stale_until: float = 0.0
    stale_reason: str = "stale"  # why it is distrusted until stale_until
    last_heard: float | None = None


@dataclass(slots=True)
class _Replica:
    sources: list[str] = field(default_factory=list)
    awaiting_since: float | None = None  # a request with new blocks was sent; no batch heard since
    pending: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash → expiry, oldest first


class ExactIndex:
    """Per-source sets of block hashes with a global hash → sources bitmask (pools/block_lru.py), and each
    replica's freshness."""

    def __init__(
        self,
        clock: Clock = time.monotonic,
        default_blocks: int = DEFAULT_BLOCKS,
        max_blocks_per_source: int = 1 << 21,
        silent_after_s: float = 10.0,
        pending_ttl_s: float = 10.0,
    ) -> None:
        if default_blocks <= 0 or max_blocks_per_source <= 0 or silent_after_s <= 0 or pending_ttl_s < 0:
            raise ValueError("capacities and silent_after_s must be positive, pending_ttl_s not negative")
        self.clock = clock
        self._default_blocks = default_blocks
        self._max_blocks = max_blocks_per_source
        self.silent_after_s = silent_after_s
        self.pending_ttl_s = pending_ttl_s
        self._sources: dict[str, _Source] = {}
        self._replicas: dict[str, _Replica] = {}
        self._sets: BlockSets[None] = BlockSets()

    # -- membership ---------------------------------------------------------------------------------------------

    def _capacity(self, kv_blocks: int | None) -> int:
        return max(1, min(self._max_blocks, kv_blocks if kv_blocks and kv_blocks > 0 else self._default_blocks))

    def add_source(self, source: str, replica: str, kv_blocks: int | None = None) -> None:
        """Register (or re-bound) an event source of `replica`; a new one starts stale until synced."""
        lru = self._sets.add(source, self._capacity(kv_blocks))
        if source not in self._sources:
            self._sources[source] = _Source(replica=replica, lru=lru)
            self._replicas.setdefault(replica, _Replica()).sources.append(source)

    def sync(self, sources: Mapping[str, tuple[str, int | None]]) -> None:
        """Make the sources exactly these (source → (replica, kv_blocks)); others are removed with their blocks."""
        for source in [s for s in self._sources if s not in sources]:
            self.remove_source(source)
        for source, (replica, kv_blocks) in sources.items():
            state = self._sources.get(source)
            if state is not None and state.replica != replica:
                self.remove_source(source)
            self.add_source(source, replica, kv_blocks)

    def remove_source(self, source: str) -> None:
        state = self._sources.pop(source, None)
        if state is None:
            return
        self._sets.remove(source)
        replica = self._replicas.get(state.replica)
        if replica is not None:
            replica.sources.remove(source)
            if not replica.sources:
                del self._replicas[state.replica]

    def sources(self) -> list[str]:
        return list(self._sources)

    def replicas(self) -> list[str]:
        return list(self._replicas)

    # -- events (pools/kv_events/) ------------------------------------------------------------------------------

    def stored(self, source: str, hashes: Iterable[int]) -> None:
        state = self._sources.get(source)
        if state is None:
            return
        pending = self._replicas[state.replica].pending
        if pending:
            hashes = list(hashes)
            for block in hashes:
                pending.pop(block, None)
        self._sets.touch(state.lru, hashes, None)

    def removed(self, source: str, hashes: Iterable[int]) -> None:
        state = self._sources.get(source)
        if state is None:
            return
        pending = self._replicas[state.replica].pending
        lru = state.lru
        discard = self._sets.discard
        for block in hashes:
            discard(lru, block)
            if pending:
                pending.pop(block, None)

    def cleared(self, source: str) -> None:
        """AllBlocksCleared, a publisher restart, or a resync: the source holds nothing (known) any more."""
        state = self._sources.get(source)
        if state is not None:
            self._sets.clear(state.lru)
            self._replicas[state.replica].pending.clear()

    def heard(self, source: str, now: float) -> None:
        """A batch (any batch) arrived from the source: its publisher is alive."""
        state = self._sources.get(source)
        if state is None:
            return
        state.last_heard = now
        self._replicas[state.replica].awaiting_since = None

    def set_live(self, source: str, live: bool, reason: str | None = None) -> None:
        """The subscriber's view of the stream: live (in sequence) or not (connecting, syncing, broken)."""
        state = self._sources.get(source)
        if state is not None:
            state.live = live
            if not live:
                state.down_reason = reason or "not_synced"

    def mark_stale(self, source: str, reason: str, until: float) -> None:
        """Distrust the source until `until` even if live (e.g. rebuilt from a partial replay)."""
        state = self._sources.get(source)
        if state is not None:
            state.stale_until = max(state.stale_until, until)
            state.stale_reason = reason

    def clear_stale(self, source: str, reason: str) -> None:
        """Trust the source again, if it was distrusted for `reason` (e.g. its hashes match again)."""
        state = self._sources.get(source)
        if state is not None and state.stale_reason == reason:
            state.stale_until = 0.0

    # -- what routing sent (HybridMatcher) ----------------------------------------------------------------------

    def sent(self, replica: str, hashes: Sequence[int], now: float) -> None:
        """The gateway sent a request with these blocks to `replica`: they are pending there, and if some were not
        held, an event batch is now due (the silence check)."""
        state = self._replicas.get(replica)
        if state is None or not hashes:
            return
        if self.match(replica, hashes, now, pending=False) < len(hashes) and state.awaiting_since is None:
            state.awaiting_since = now
        if self.pending_ttl_s <= 0:
            return
        pending = state.pending
        expiry = now + self.pending_ttl_s
        for block in reversed(hashes):
            pending[block] = expiry
            pending.move_to_end(block)
        self._expire_pending(state, now)
        limit = max(self._sources[s].lru.capacity for s in state.sources)
        while len(pending) > limit:
            pending.popitem(last=False)

    @staticmethod
    def _expire_pending(state: _Replica, now: float) -> None:
        pending = state.pending
        while pending:
            block, expiry = next(iter(pending.items()))
            if expiry > now:
                break
            pending.popitem(last=False)

    # -- freshness ----------------------------------------------------------------------------------------------

    def stale_reason(self, replica: str, now: float) -> str | None:
        """Why the replica's exact view must not be trusted now, or None when it is fresh."""
        state = self._replicas.get(replica)
        if state is None:
            return "no_events"
        for source in state.sources:
            src = self._sources[source]
            if not src.live:
                return src.down_reason
            if now < src.stale_until:
                return src.stale_reason
        if state.awaiting_since is not None and now - state.awaiting_since > self.silent_after_s:
            return "silent"
        return None

    def fresh(self, replica: str, now: float) -> bool:
        return self.stale_reason(replica, now) is None

    # -- queries ------------------------------------------------------------------------------------------------

    def match(self, replica: str, hashes: Sequence[int], now: float, pending: bool = True) -> int:
        """Leading blocks of `hashes` the replica holds (any of its ranks), pending ones counting when asked."""
        state = self._replicas.get(replica)
        if state is None:
            return 0
        best = 0
        for source in state.sources:
            count = self._sets.match(source, hashes)
            if count > best:
                best = count
        return self._extend_pending(state, hashes, best, now) if pending else best

    def _extend_pending(self, state: _Replica, hashes: Sequence[int], start: int, now: float) -> int:
        pending = state.pending
        if not pending:
            return start
        count = start
        while count < len(hashes):
            expiry = pending.get(hashes[count])
            if expiry is None or expiry <= now:
                break
            count += 1
        return count

    def match_all(self, hashes: Sequence[int], now: float | None = None) -> dict[str, int]:
        """Leading blocks held per replica (best rank), pending blocks included; replicas with none left out."""
        now = self.clock() if now is None else now
        by_source = self._sets.match_all(hashes)
        out: dict[str, int] = {}
        for source, count in by_source.items():
            replica = self._sources[source].replica
            if count > out.get(replica, 0):
                out[replica] = count
        for replica, state in self._replicas.items():
            if state.pending:
                count = self._extend_pending(state, hashes, out.get(replica, 0), now)
                if count:
                    out[replica] = count
        return out

    # -- introspection ------------------------------------------------------------------------------------------

    def size(self, replica: str) -> int:
        state = self._replicas.get(replica)
        return sum(len(self._sources[s].lru.entries) for s in state.sources) if state else 0

    def pending_size(self, replica: str) -> int:
        state = self._replicas.get(replica)
        return len(state.pending) if state else 0

    def capacity(self, source: str) -> int:
        state = self._sources.get(source)
        return state.lru.capacity if state else self._capacity(None)

    def distinct_blocks(self) -> int:
        return self._sets.distinct()

    def overflow_evictions(self) -> int:
        """Blocks dropped because a source's set outgrew its replica's KV (lost BlockRemoved events)."""
        return sum(s.lru.evicted for s in self._sources.values())

    def __len__(self) -> int:
        return len(self._sets)


@dataclass(slots=True)
class MatchCounters:
    """What the hybrid matcher did, for /metrics: replicas scored per source, and why exact was not used."""

    requests_exact: int = 0  # requests that carried exact block hashes
    requests_approx_only: int = 0  # requests without (media, other APIs, tokenizer off or failed)
    replicas_exact: int = 0  # replica scorings from the exact index
    replicas_approx: int = 0  # replica scorings from the approximate index (no exact hashes, or stale)
    stale_fallbacks: dict[str, int] = field(default_factory=dict)  # reason → replica scorings that fell back


class HybridMatcher:
    """PrefixAffinity's matcher when a pool routes precisely: exact matched lengths (vLLM blocks) for replicas whose
    exact view is fresh, the approximate index's estimate for the others.

    Still a plain `PrefixMatcher` (match_all / record go to the approximate index, which keeps learning so that a
    fallback is never cold), plus `match_request` / `record_request`, which PrefixAffinity prefers when present."""

    def __init__(self, approx: PrefixIndex, exact: ExactIndex, clock: Clock | None = None) -> None:
        self.approx = approx
        self.exact = exact
        self.clock = clock or exact.clock
        self.counters = MatchCounters()

    # PrefixMatcher
    def match_all(self, hashes: Sequence[int]) -> Mapping[str, int]:
        return self.approx.match_all(hashes)

    def record(self, replica: str, hashes: Sequence[int], now: float) -> None:
        self.approx.record(replica, hashes, now)

    # request-level
    def match_request(self, request: RoutingRequest, replicas: Iterable[str]) -> PrefixMatch:
        """Matched blocks per replica and which replicas were scored exactly."""
        counters = self.counters
        approx = self.approx.match_all(request.block_hashes) if request.block_hashes else {}
        if not request.exact_block_hashes:
            counters.requests_approx_only += 1
            return PrefixMatch(approx, frozenset())
        counters.requests_exact += 1
        now = self.clock()
        exact = self.exact.match_all(request.exact_block_hashes, now)
        blocks: dict[str, int] = {}
        fresh: set[str] = set()
        for url in replicas:
            reason = self.exact.stale_reason(url, now)
            if reason is None:
                fresh.add(url)
                counters.replicas_exact += 1
                if exact.get(url):
                    blocks[url] = exact[url]
            else:
                counters.replicas_approx += 1
                counters.stale_fallbacks[reason] = counters.stale_fallbacks.get(reason, 0) + 1
                if approx.get(url):
                    blocks[url] = approx[url]
        return PrefixMatch(blocks, frozenset(fresh))

    def record_request(self, request: RoutingRequest, replica: str, now: float) -> None:
        if request.block_hashes:
            self.approx.record(replica, request.block_hashes, now)
        if request.exact_block_hashes:
            self.exact.sent(replica, request.exact_block_hashes, now)
