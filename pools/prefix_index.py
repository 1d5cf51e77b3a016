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

from collections.abc import Iterable, Mapping, Sequence

from pools.block_lru import BlockLRU, BlockSets

__all__ = ["PrefixIndex", "DEFAULT_BLOCKS"]

DEFAULT_BLOCKS = 16_384
"""Capacity for a replica whose KV size is unknown: 2M tokens of 128-token blocks, about one 8-GPU node's cache."""


class PrefixIndex:
    """Per-replica LRU of block hashes, bounded by each replica's KV blocks, with a global hash → replicas map
    (pools/block_lru.py), each block valued by when it was last sent."""

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
        self._sets: BlockSets[float] = BlockSets()

    # -- membership ---------------------------------------------------------------------------------------------

    def _capacity(self, kv_blocks: int | None) -> int:
        blocks = kv_blocks if kv_blocks and kv_blocks > 0 else self._default_blocks
        return max(1, min(self._max_blocks, int(blocks * self._fraction)))

    def _replica(self, replica: str) -> BlockLRU[float]:
        lru = self._sets.lrus.get(replica)
        return lru if lru is not None else self._sets.add(replica, self._capacity(None))

    def resize(self, replica: str, kv_blocks: int | None) -> None:
        """Set a replica's capacity from its KV blocks (None → the default), evicting down to it at once."""
        self._sets.add(replica, self._capacity(kv_blocks))

    def sync(self, kv_blocks_by_replica: Mapping[str, int | None]) -> None:
        """Make the index's replicas exactly these (url → kv_blocks or None): one call after discovery, a config
        reload, or a scrape that learnt a replica's KV size. Replicas not listed are removed."""
        for replica in [r for r in self._sets.lrus if r not in kv_blocks_by_replica]:
            self.remove_replica(replica)
        for replica, kv_blocks in kv_blocks_by_replica.items():
            self._sets.add(replica, self._capacity(kv_blocks))

    def remove_replica(self, replica: str) -> None:
        """Forget a replica and everything recorded for it (it left the pool)."""
        self._sets.remove(replica)

    def clear_replica(self, replica: str) -> None:
        """Forget a replica's blocks but keep it (it restarted, or its prefix cache was reset)."""
        lru = self._sets.lrus.get(replica)
        if lru is not None:
            self._sets.clear(lru)

    # -- recording and expiry -----------------------------------------------------------------------------------

    def record(self, replica: str, hashes: Sequence[int], now: float) -> None:
        """Note that a request with these leading block hashes was sent to `replica` at monotonic time `now`.

        Blocks are touched last-to-first, so the leading (most shared) blocks are the most recent and are forgotten
        last, as vLLM frees a request's tail blocks before its head.
        """
        lru = self._replica(replica)
        self._sets.touch(lru, reversed(hashes), now)
        if self._ttl_s is not None:
            self._expire_one(lru, now - self._ttl_s)

    def expire(self, now: float) -> int:
        """Forget blocks older than ttl_s on every replica (call it now and then); returns how many were dropped."""
        if self._ttl_s is None:
            return 0
        return sum(self._expire_one(lru, now - self._ttl_s) for lru in self._sets.lrus.values())

    def _expire_one(self, lru: BlockLRU[float], cutoff: float) -> int:
        entries = lru.entries
        dropped = 0
        while entries and next(iter(entries.values())) < cutoff:
            self._sets.pop_oldest(lru)
            dropped += 1
        return dropped

    # -- queries ------------------------------------------------------------------------------------------------

    def match(self, replica: str, hashes: Iterable[int]) -> int:
        """How many leading blocks of `hashes` the replica probably still holds."""
        return self._sets.match(replica, hashes)

    def match_all(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks held, per replica, in one pass over `hashes`. Replicas that hold none are left out."""
        return self._sets.match_all(hashes)

    # -- introspection (admin API, tests) -----------------------------------------------------------------------

    def replicas(self) -> list[str]:
        return list(self._sets.lrus)

    def size(self, replica: str) -> int:
        lru = self._sets.lrus.get(replica)
        return len(lru.entries) if lru else 0

    def capacity(self, replica: str) -> int:
        lru = self._sets.lrus.get(replica)
        return lru.capacity if lru else self._capacity(None)

    def distinct_blocks(self) -> int:
        """Entries of the global map: never more than the sum of the replicas' sizes."""
        return self._sets.distinct()

    def __len__(self) -> int:
        return len(self._sets)
