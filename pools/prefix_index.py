"""Which prefix blocks each replica probably still holds in its KV cache: a bounded, approximate index.

The gateway cannot see a replica's KV cache, only what it sent there. So for each replica it keeps an LRU of the
block hashes (policies/prefix.py) it has sent, capped at that replica's KV capacity in blocks: once more distinct
blocks have gone there than fit in its cache, the oldest must have been evicted by vLLM too, and are forgotten here.
Peer routers that kept an unbounded trie leaked memory until they were OOM-killed (production-stack #687, #858);
this index is bounded by the sum of the replicas' capacities, and removing a replica frees its entries.

Beside the per-replica LRUs, a hash → bitmask-of-replicas map answers "how many leading blocks does each replica
hold" for all replicas in one pass over the request's hashes (`match_all`), which is what routing needs.

Plain, synchronous and in memory; the gateway owns one per pool set and calls it from its event loop. A shared
(Redis) version will mirror `record()` calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["PrefixIndex", "DEFAULT_BLOCKS"]

DEFAULT_BLOCKS = 16_384
"""Capacity for a replica whose KV size is unknown: 2M tokens of 128-token blocks, about one 8-GPU node's cache."""


@dataclass(slots=True)
class _ReplicaBlocks:
    bit: int  # this replica's bit in PrefixIndex._holders masks
    capacity: int
    entries: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash → last time sent, oldest first


class PrefixIndex:
    """Per-replica LRU of block hashes, bounded by each replica's KV blocks, with a global hash → replicas map."""

    def __init__(
        self,
        default_blocks: int = DEFAULT_BLOCKS,
        max_blocks_per_replica: int = 1 << 21,
        capacity_fraction: float = 1.0,
        ttl_s: float | None = None,
    ) -> None:
        """`capacity_fraction` scales kv_blocks (part of the cache holds running requests' outputs); `ttl_s`
        forgets blocks not sent for that long (useful when other gateways fill the same replicas unseen)."""
        if default_blocks <= 0 or max_blocks_per_replica <= 0 or not 0 < capacity_fraction <= 1:
            raise ValueError("capacities must be positive and capacity_fraction in (0, 1]")
        self._default_blocks = default_blocks
        self._max_blocks = max_blocks_per_replica
        self._fraction = capacity_fraction
        self._ttl_s = ttl_s
        self._replicas: dict[str, _ReplicaBlocks] = {}
        self._by_bit: dict[int, str] = {}
        self._holders: dict[int, int] = {}  # block hash → bitmask of replicas holding it

    # -- membership ---------------------------------------------------------------------------------------------

    def _capacity(self, kv_blocks: int | None) -> int:
        blocks = kv_blocks if kv_blocks and kv_blocks > 0 else self._default_blocks
        return max(1, min(self._max_blocks, int(blocks * self._fraction)))

    def _replica(self, replica: str) -> _ReplicaBlocks:
        state = self._replicas.get(replica)
        if state is None:
            bit = next(b for b in range(len(self._by_bit) + 1) if b not in self._by_bit)
            state = _ReplicaBlocks(bit=bit, capacity=self._capacity(None))
            self._replicas[replica] = state
            self._by_bit[bit] = replica
        return state

    def resize(self, replica: str, kv_blocks: int | None) -> None:
        """Set a replica's capacity from its KV blocks (None → the default), evicting down to it at once."""
        state = self._replica(replica)
        state.capacity = self._capacity(kv_blocks)
        self._evict_over(state)

    def sync(self, kv_blocks_by_replica: Mapping[str, int | None]) -> None:
        """Make the index's replicas exactly these (url → kv_blocks or None): one call after discovery, a config
        reload, or a scrape that learnt a replica's KV size. Replicas not listed are removed."""
        for replica in [r for r in self._replicas if r not in kv_blocks_by_replica]:
            self.remove_replica(replica)
        for replica, kv_blocks in kv_blocks_by_replica.items():
            state = self._replicas.get(replica)
            if state is None or state.capacity != self._capacity(kv_blocks):
                self.resize(replica, kv_blocks)

    def remove_replica(self, replica: str) -> None:
        """Forget a replica and everything recorded for it (it left the pool)."""
        state = self._replicas.pop(replica, None)
        if state is None:
            return
        self._drop_all(state)
        del self._by_bit[state.bit]

    def clear_replica(self, replica: str) -> None:
        """Forget a replica's blocks but keep it (it restarted, or its prefix cache was reset)."""
        state = self._replicas.get(replica)
        if state is not None:
            self._drop_all(state)

    def _drop_all(self, state: _ReplicaBlocks) -> None:
        keep = ~(1 << state.bit)
        holders = self._holders
        for block in state.entries:
            mask = holders[block] & keep
            if mask:
                holders[block] = mask
            else:
                del holders[block]
        state.entries.clear()

    # -- recording and expiry -----------------------------------------------------------------------------------

    def record(self, replica: str, hashes: Sequence[int], now: float) -> None:
        """Note that a request with these leading block hashes was sent to `replica` at monotonic time `now`.

        Blocks are touched last-to-first, so the leading (most shared) blocks are the most recent and are forgotten
        last, as vLLM frees a request's tail blocks before its head.
        """
        state = self._replica(replica)
        entries = state.entries
        holders = self._holders
        bit = 1 << state.bit
        for block in reversed(hashes):
            if block in entries:
                entries[block] = now
                entries.move_to_end(block)
            else:
                entries[block] = now
                holders[block] = holders.get(block, 0) | bit
        self._evict_over(state)
        if self._ttl_s is not None:
            self._expire_one(state, now - self._ttl_s)

    def expire(self, now: float) -> int:
        """Forget blocks older than ttl_s on every replica (call it now and then); returns how many were dropped."""
        if self._ttl_s is None:
            return 0
        return sum(self._expire_one(state, now - self._ttl_s) for state in self._replicas.values())

    def _evict_over(self, state: _ReplicaBlocks) -> None:
        entries = state.entries
        while len(entries) > state.capacity:
            block, _ = entries.popitem(last=False)
            self._release(block, state.bit)

    def _expire_one(self, state: _ReplicaBlocks, cutoff: float) -> int:
        entries = state.entries
        dropped = 0
        while entries:
            block, sent_at = next(iter(entries.items()))
            if sent_at >= cutoff:
                break
            entries.popitem(last=False)
            self._release(block, state.bit)
            dropped += 1
        return dropped

    def _release(self, block: int, bit: int) -> None:
        mask = self._holders[block] & ~(1 << bit)
        if mask:
            self._holders[block] = mask
        else:
            del self._holders[block]

    # -- queries ------------------------------------------------------------------------------------------------

    def match(self, replica: str, hashes: Iterable[int]) -> int:
        """How many leading blocks of `hashes` the replica probably still holds."""
        state = self._replicas.get(replica)
        if state is None:
            return 0
        entries = state.entries
        count = 0
        for block in hashes:
            if block not in entries:
                break
            count += 1
        return count

    def match_all(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks held, per replica, in one pass over `hashes`. Replicas that hold none are left out."""
        holders = self._holders
        alive = -1  # every bit: narrowed to the replicas still matching after each block
        matched: dict[str, int] = {}
        for position, block in enumerate(hashes):
            mask = holders.get(block, 0) & alive
            dropped = alive & ~mask if position else 0
            while dropped:
                low = dropped & -dropped
                replica = self._by_bit.get(low.bit_length() - 1)
                if replica is not None:
                    matched[replica] = position
                dropped ^= low
            alive = mask
            if not alive:
                return matched
        if hashes:
            while alive:
                low = alive & -alive
                replica = self._by_bit.get(low.bit_length() - 1)
                if replica is not None:
                    matched[replica] = len(hashes)
                alive ^= low
        return matched

    # -- introspection (admin API, tests) -----------------------------------------------------------------------

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def size(self, replica: str) -> int:
        state = self._replicas.get(replica)
        return len(state.entries) if state else 0

    def capacity(self, replica: str) -> int:
        state = self._replicas.get(replica)
        return state.capacity if state else self._capacity(None)

    def distinct_blocks(self) -> int:
        """Entries of the global map: never more than the sum of the replicas' sizes."""
        return len(self._holders)

    def __len__(self) -> int:
        return sum(len(state.entries) for state in self._replicas.values())
