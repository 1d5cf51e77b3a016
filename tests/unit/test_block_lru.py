"""pools/block_lru.py: the per-key LRU block sets both prefix indexes are built on."""

from __future__ import annotations

import random

from pools.block_lru import BlockSets


def consistent(sets: BlockSets) -> bool:
    """holders[block] has exactly the bits of the keys whose LRU holds the block."""
    expected: dict[int, int] = {}
    for lru in sets.lrus.values():
        for block in lru.entries:
            expected[block] = expected.get(block, 0) | (1 << lru.bit)
    return expected == sets.holders


def test_touch_adds_refreshes_and_evicts_the_oldest_beyond_capacity() -> None:
    sets: BlockSets[float] = BlockSets()
    a = sets.add("a", capacity=3)
    sets.touch(a, [1, 2, 3], 0.0)
    sets.touch(a, [1], 1.0)  # 1 is now the newest
    sets.touch(a, [4], 2.0)  # 2 goes
    assert list(a.entries.items()) == [(3, 0.0), (1, 1.0), (4, 2.0)]
    assert a.evicted == 1 and 2 not in sets.holders and consistent(sets)


def test_match_and_match_all_count_leading_blocks_per_key() -> None:
    sets: BlockSets[None] = BlockSets()
    sets.touch(sets.add("a", 10), [1, 2, 3], None)
    sets.touch(sets.add("b", 10), [1, 2], None)
    sets.touch(sets.add("c", 10), [9], None)
    assert sets.match_all([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert sets.match_all([1, 2]) == {"a": 2, "b": 2}
    assert sets.match_all([]) == {}
    assert sets.match("a", [1, 2, 5]) == 2 and sets.match("c", [1]) == 0 and sets.match("zz", [1]) == 0


def test_discard_clear_and_remove_keep_the_bitmasks_exact_and_reuse_bits() -> None:
    sets: BlockSets[None] = BlockSets()
    a, b = sets.add("a", 10), sets.add("b", 10)
    sets.touch(a, [1, 2], None)
    sets.touch(b, [2, 3], None)
    assert sets.discard(a, 2) and not sets.discard(a, 2)
    assert sets.holders == {1: 1 << a.bit, 2: 1 << b.bit, 3: 1 << b.bit}
    sets.clear(b)
    assert sets.holders == {1: 1 << a.bit} and "b" in sets.lrus
    sets.touch(b, [7], None)
    assert sets.remove("b") is b and sets.remove("b") is None
    assert sets.holders == {1: 1 << a.bit} and len(sets) == 1 and sets.distinct() == 1
    assert sets.add("c", 10).bit == b.bit  # the freed bit is reused


def test_re_bounding_a_key_evicts_down_to_its_new_capacity() -> None:
    sets: BlockSets[None] = BlockSets()
    a = sets.add("a", 5)
    sets.touch(a, range(5), None)
    assert sets.add("a", 2) is a
    assert list(a.entries) == [3, 4] and consistent(sets)


def test_pop_oldest_returns_the_least_recent_with_its_value() -> None:
    sets: BlockSets[float] = BlockSets()
    a = sets.add("a", 5)
    sets.touch(a, [5, 6], 1.5)
    assert sets.pop_oldest(a) == (5, 1.5) and list(sets.holders) == [6]


def test_random_operations_keep_holders_consistent_and_bounded() -> None:
    rnd = random.Random(4)
    sets: BlockSets[None] = BlockSets()
    for _ in range(3000):
        key = f"k{rnd.randrange(6)}"
        op = rnd.random()
        if op < 0.6:
            sets.touch(sets.add(key, rnd.choice([4, 8, 16])), [rnd.randrange(40) for _ in range(5)], None)
        elif op < 0.8 and key in sets.lrus:
            sets.discard(sets.lrus[key], rnd.randrange(40))
        elif op < 0.9:
            sets.remove(key)
        elif key in sets.lrus:
            sets.clear(sets.lrus[key])
        assert all(len(lru.entries) <= lru.capacity for lru in sets.lrus.values())
    assert consistent(sets)
