"""Bounded per-key LRU sets of block hashes sharing one hash → bitmask-of-keys map.

Both prefix indexes are made of this: pools/prefix_index.py (per replica, the blocks the gateway *sent*, valued by
when they were sent) and pools/exact_index.py (per KV-event source, the blocks a replica *reports* holding). Each key
(a replica URL, an event source) gets a bit; `holders[block]` carries the bits of every key whose LRU holds the
block, so the leading blocks each key holds are found in one pass over a request's hashes (`match_all`), and
dropping a key frees all it had.

Plain and synchronous. The owners keep their own policy on top (capacities from KV sizes, expiry, pending blocks,
freshness); this module only keeps the sets and the bitmasks consistent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["BlockLRU", "BlockSets"]

V = TypeVar("V")


@dataclass(slots=True)
class BlockLRU(Generic[V]):
    """One key's blocks, oldest first, each with its owner's value (a send time, or None)."""

    key: str
    bit: int  # this key's bit in BlockSets.holders masks
    capacity: int
    entries: OrderedDict[int, V] = field(default_factory=OrderedDict)
    evicted: int = 0  # blocks dropped because the LRU was over capacity


class BlockSets(Generic[V]):
    """Keys, each with a bounded LRU of block hashes, and for every block held the bitmask of its holders."""

    __slots__ = ("lrus", "holders", "_by_bit")

    def __init__(self) -> None:
        self.lrus: dict[str, BlockLRU[V]] = {}
        self.holders: dict[int, int] = {}  # block hash → bitmask of the keys holding it
        self._by_bit: dict[int, str] = {}

    # -- keys ---------------------------------------------------------------------------------------------------

    def add(self, key: str, capacity: int) -> BlockLRU[V]:
        """The key's LRU, created empty if new; an existing one is re-bounded (evicting down to `capacity`)."""
        lru = self.lrus.get(key)
        if lru is None:
            bit = next(b for b in range(len(self._by_bit) + 1) if b not in self._by_bit)
            lru = BlockLRU(key, bit, capacity)
            self.lrus[key] = lru
            self._by_bit[bit] = key
        elif lru.capacity != capacity:
            lru.capacity = capacity
            self.evict_over(lru)
        return lru

    def remove(self, key: str) -> BlockLRU[V] | None:
        """Forget the key and free everything it held (its bit is reused by the next key added)."""
        lru = self.lrus.pop(key, None)
        if lru is not None:
            self.clear(lru)
            del self._by_bit[lru.bit]
        return lru

    def clear(self, lru: BlockLRU[V]) -> None:
        """Empty the key's LRU, keeping the key."""
        keep = ~(1 << lru.bit)
        holders = self.holders
        for block in lru.entries:
            mask = holders.get(block, 0) & keep
            if mask:
                holders[block] = mask
            else:
                holders.pop(block, None)
        lru.entries.clear()

    # -- blocks -------------------------------------------------------------------------------------------------

    def touch(self, lru: BlockLRU[V], blocks: Iterable[int], value: V) -> None:
        """Add the blocks, or refresh them to most recent, in the order given (the last one ends newest); then evict
        the oldest ones beyond capacity."""
        entries = lru.entries
        holders = self.holders
        bit = 1 << lru.bit
        for block in blocks:
            if block in entries:
                entries[block] = value
                entries.move_to_end(block)
            else:
                entries[block] = value
                holders[block] = holders.get(block, 0) | bit
        if len(entries) > lru.capacity:
            self.evict_over(lru)

    def discard(self, lru: BlockLRU[V], block: int) -> bool:
        """Drop one block if held; returns whether it was."""
        if lru.entries.pop(block, _MISSING) is _MISSING:
            return False
        self._release(block, lru.bit)
        return True

    def pop_oldest(self, lru: BlockLRU[V]) -> tuple[int, V]:
        """Drop and return the least recent (block, value); the LRU must not be empty."""
        block, value = lru.entries.popitem(last=False)
        self._release(block, lru.bit)
        return block, value

    def evict_over(self, lru: BlockLRU[V]) -> int:
        """Drop the oldest blocks until the LRU fits its capacity; returns how many went."""
        entries = lru.entries
        dropped = 0
        while len(entries) > lru.capacity:
            block, _ = entries.popitem(last=False)
            self._release(block, lru.bit)
            dropped += 1
        lru.evicted += dropped
        return dropped

    def _release(self, block: int, bit: int) -> None:
        holders = self.holders
        mask = holders.get(block, 0) & ~(1 << bit)
        if mask:
            holders[block] = mask
        else:
            holders.pop(block, None)

    # -- queries ------------------------------------------------------------------------------------------------

    def match(self, key: str, hashes: Iterable[int]) -> int:
        """How many leading blocks of `hashes` the key holds."""
        lru = self.lrus.get(key)
        if lru is None:
            return 0
        entries = lru.entries
        count = 0
        for block in hashes:
            if block not in entries:
                break
            count += 1
        return count

    def match_all(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks held, per key, in one pass: a bitmask of the keys still matching is narrowed block by
        block. Keys that hold none are left out."""
        holders = self.holders
        by_bit = self._by_bit
        alive = -1  # every bit
        matched: dict[str, int] = {}
        for position, block in enumerate(hashes):
            mask = holders.get(block, 0) & alive
            dropped = alive & ~mask if position else 0
            while dropped:
                low = dropped & -dropped
                key = by_bit.get(low.bit_length() - 1)
                if key is not None:
                    matched[key] = position
                dropped ^= low
            alive = mask
            if not alive:
                return matched
        if hashes:
            while alive:
                low = alive & -alive
                key = by_bit.get(low.bit_length() - 1)
                if key is not None:
                    matched[key] = len(hashes)
                alive ^= low
        return matched

    def distinct(self) -> int:
        """Blocks held by any key: never more than the sum of the LRUs' sizes."""
        return len(self.holders)

    def __len__(self) -> int:
        return sum(len(lru.entries) for lru in self.lrus.values())


_MISSING = object()
