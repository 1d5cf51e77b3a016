"""Paged KV-cache blocks as vLLM v1's block pool manages them.

A block is in use (ref count > 0) or free. Free blocks wait in one LRU queue; a free block may still back a prefix
hash, so it can be revived by a later hit until allocation reaches it at the head of the queue and evicts it.
Requests free their blocks last-block-first, so a prompt's shared head outlives its private tail (as vLLM does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pools.sim.prefix_cache import PrefixCache


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = prefix_cache
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """vllm:kv_cache_usage_perc: the share of blocks in use (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def cached_hash(self, block: int) -> int | None:
        return self._hash[block]

    def find_cached(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Blocks of the longest cached prefix. At most `num_tokens - 1` tokens may hit: the last prompt token is
        always recomputed to get logits, which is why a prompt of exactly k full blocks hits only k-1."""
        if self.cache is None:
            return []
        return self.cache.longest_hit(hashes, (num_tokens - 1) // self.block_size)

    def allocate(self, blocks: list[int], num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow `blocks` in place to hold `num_tokens`, first adopting `cached` (prefix hits). All or nothing."""
        need = blocks_for(num_tokens, self.block_size) - len(blocks) - len(cached)
        reviving = sum(1 for b in cached if self._ref[b] == 0)
        if need > len(self._free) - reviving:
            return False
        for b in cached:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
            blocks.append(b)
        for _ in range(need):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                self._hash[b] = None
                if self.cache is not None:
                    self.cache.evict(h)
            self._ref[b] = 1
            blocks.append(b)
        return True

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[int], first: int, upto: int) -> None:
        """Register blocks[first:upto], now full of prompt KV, under hashes[first:upto]."""
        if self.cache is None or upto <= first:
            return
        parent = hashes[first - 1] if first > 0 else None
        stored = self.cache.store(parent, hashes[first:upto], blocks[first:upto])
        for ok, b, h in zip(stored, blocks[first:upto], hashes[first:upto]):
            if ok:
                self._hash[b] = h

    def free(self, blocks: Sequence[int]) -> None:
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (POST /sim/reset); blocks in use stay allocated."""
        for b, h in enumerate(self._hash):
            if h is not None:
                self._hash[b] = None
        if self.cache is not None:
            self.cache.clear()
