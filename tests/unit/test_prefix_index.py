"""The per-replica prefix index stays within each replica's KV capacity, forgets like an LRU cache, and frees
what a removed replica held."""

from __future__ import annotations

import gc
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pools.prefix_index import PrefixIndex


def _blocks(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_match_counts_leading_blocks_only() -> None:
    index = PrefixIndex()
    index.record("a", (1, 2, 3, 4), now=0.0)
    assert index.match("a", (1, 2, 3, 4, 5)) == 4
    assert index.match("a", (1, 2, 9, 4)) == 2  # a gap ends the match even if later blocks are present
    assert index.match("a", (9, 1, 2)) == 0
    assert index.match("never-seen", (1, 2)) == 0
    assert index.match("a", ()) == 0


def test_match_all_agrees_with_match_and_leaves_out_zero() -> None:
    index = PrefixIndex()
    index.record("a", (1, 2, 3, 4), now=0.0)
    index.record("b", (1, 2), now=0.0)
    index.record("c", (7, 8), now=0.0)
    assert index.match_all((1, 2, 3, 5)) == {"a": 3, "b": 2}
    assert index.match_all((1, 2, 3, 4)) == {"a": 4, "b": 2}
    assert index.match_all((5,)) == {}
    assert index.match_all(()) == {}


def test_entries_stay_at_the_replica_capacity_after_100k_inserts() -> None:
    index = PrefixIndex()
    index.resize("a", kv_blocks=1000)
    index.resize("b", kv_blocks=500)
    for i in range(0, 100_000, 50):
        index.record("a", _blocks(i, 50), now=float(i))
        index.record("b", _blocks(i + 1_000_000, 50), now=float(i))
    assert index.size("a") == 1000 and index.size("b") == 500
    assert index.distinct_blocks() == 1500
    assert len(index) == 1500


def test_unknown_kv_size_uses_the_default_and_capacity_is_capped() -> None:
    index = PrefixIndex(default_blocks=100, max_blocks_per_replica=300)
    index.record("a", _blocks(0, 250), now=0.0)
    assert index.size("a") == 100
    index.resize("a", kv_blocks=10_000_000)
    assert index.capacity("a") == 300
    half = PrefixIndex(capacity_fraction=0.5)
    half.resize("a", kv_blocks=1000)
    assert half.capacity("a") == 500


def test_oldest_requests_are_forgotten_first_and_a_touch_refreshes() -> None:
    index = PrefixIndex()
    index.resize("a", kv_blocks=30)
    index.record("a", _blocks(100, 10), now=1.0)  # A
    index.record("a", _blocks(200, 10), now=2.0)  # B
    index.record("a", _blocks(300, 10), now=3.0)  # C
    index.record("a", _blocks(100, 10), now=4.0)  # A again: now the most recent
    index.record("a", _blocks(400, 10), now=5.0)  # D pushes out the least recently sent: B
    assert index.match("a", _blocks(100, 10)) == 10
    assert index.match("a", _blocks(200, 10)) == 0
    assert index.match("a", _blocks(300, 10)) == 10
    assert index.match("a", _blocks(400, 10)) == 10


def test_a_request_longer_than_the_cache_keeps_its_leading_blocks() -> None:
    """vLLM frees a request's tail blocks before its head, so the head is what survives."""
    index = PrefixIndex()
    index.resize("a", kv_blocks=8)
    index.record("a", _blocks(0, 20), now=0.0)
    assert index.match("a", _blocks(0, 20)) == 8


def test_shrinking_evicts_at_once() -> None:
    index = PrefixIndex()
    index.record("a", _blocks(0, 100), now=0.0)
    index.resize("a", kv_blocks=10)
    assert index.size("a") == 10
    assert index.match("a", _blocks(0, 100)) == 10
    assert index.distinct_blocks() == 10


def test_removing_a_replica_frees_its_entries_and_keeps_the_others() -> None:
    index = PrefixIndex()
    index.record("a", _blocks(0, 100), now=0.0)
    index.record("b", _blocks(50, 100), now=0.0)
    index.remove_replica("a")
    assert "a" not in index.replicas()
    assert index.size("a") == 0
    assert index.distinct_blocks() == 100  # only b's blocks remain in the global map
    assert index.match_all(_blocks(50, 100)) == {"b": 100}
    assert index.match_all(_blocks(0, 10)) == {}
    # a replica added later (which may reuse a's internal slot) inherits nothing from a
    index.record("c", (999,), now=1.0)
    assert index.match_all(_blocks(0, 10)) == {}
    assert index.match_all(_blocks(50, 3)) == {"b": 3}
    index.remove_replica("b")
    index.remove_replica("c")
    index.remove_replica("never-added")
    assert index.distinct_blocks() == 0 and len(index) == 0


def test_sync_adds_resizes_and_removes_replicas() -> None:
    index = PrefixIndex(default_blocks=50)
    index.record("a", _blocks(0, 40), now=0.0)
    index.record("gone", _blocks(0, 40), now=0.0)
    index.sync({"a": 20, "b": None})
    assert sorted(index.replicas()) == ["a", "b"]
    assert index.capacity("a") == 20 and index.size("a") == 20
    assert index.capacity("b") == 50
    assert index.match_all(_blocks(0, 40)) == {"a": 20}
    index.sync({"a": 20, "b": None})  # unchanged: nothing is dropped
    assert index.size("a") == 20


def test_clear_replica_forgets_blocks_but_keeps_capacity() -> None:
    index = PrefixIndex()
    index.resize("a", kv_blocks=77)
    index.record("a", _blocks(0, 10), now=0.0)
    index.clear_replica("a")
    assert index.match("a", _blocks(0, 10)) == 0
    assert index.capacity("a") == 77
    assert index.distinct_blocks() == 0


def test_ttl_forgets_blocks_not_sent_for_a_while() -> None:
    index = PrefixIndex(ttl_s=60.0)
    index.record("a", _blocks(0, 5), now=0.0)
    index.record("b", _blocks(0, 5), now=0.0)
    index.record("a", _blocks(100, 5), now=50.0)
    assert index.expire(now=70.0) == 10  # a's and b's blocks from t=0
    assert index.match_all(_blocks(0, 5)) == {}
    assert index.match("a", _blocks(100, 5)) == 5
    index.record("a", _blocks(200, 5), now=200.0)  # record() expires the replica's old blocks as it goes
    assert index.size("a") == 5
    assert PrefixIndex().expire(now=1e9) == 0


def test_memory_is_bounded_by_capacity_not_by_traffic() -> None:
    def measure(inserts: int) -> int:
        gc.collect()
        tracemalloc.start()
        index = PrefixIndex()
        for replica in ("a", "b", "c", "d"):
            index.resize(replica, kv_blocks=10_000)
        for i in range(0, inserts, 64):
            index.record("abcd"[(i // 64) % 4], _blocks(i, 64), now=float(i))
        current, _peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(index) <= 40_000
        return current

    warmed_up = measure(100_000)  # past the first hash-table growth caused by churn
    after_much_more = measure(400_000)
    assert after_much_more < warmed_up * 1.1
    assert after_much_more < 40_000 * 400  # < 400 bytes per held block (215 measured)


def test_match_all_is_fast_enough_for_the_hot_path() -> None:
    index = PrefixIndex()
    request = _blocks(0, 64)  # an 8K-token prompt
    for n, replica in enumerate(f"r{i}" for i in range(16)):
        index.record(replica, request[: 4 * n], now=0.0)
    start = time.perf_counter()
    for _ in range(2000):
        index.match_all(request)
    per_call = (time.perf_counter() - start) / 2000
    assert index.match_all(request)["r15"] == 60
    assert per_call < 100e-6, f"{per_call * 1e6:.1f} µs"  # ~8 µs here


def test_invalid_capacities_are_rejected() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(default_blocks=0)
    with pytest.raises(ValueError):
        PrefixIndex(capacity_fraction=1.5)


# -- against a brute-force model ------------------------------------------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.sampled_from("abcd"), st.lists(st.integers(0, 30), max_size=12)),
        st.tuples(st.just("remove"), st.sampled_from("abcd"), st.just([])),
        st.tuples(st.just("resize"), st.sampled_from("abcd"), st.lists(st.integers(1, 12), min_size=1, max_size=1)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, probe=st.lists(st.integers(0, 30), max_size=12))
def test_index_behaves_like_one_lru_list_per_replica(ops: list, probe: list[int]) -> None:
    index = PrefixIndex(default_blocks=8)
    model: dict[str, list[int]] = {}  # most recent last
    capacity: dict[str, int] = {}
    for op, replica, arg in ops:
        if op == "record":
            index.record(replica, arg, now=0.0)
            lru = model.setdefault(replica, [])
            for block in reversed(arg):
                if block in lru:
                    lru.remove(block)
                lru.append(block)
            del lru[: max(0, len(lru) - capacity.get(replica, 8))]
        elif op == "remove":
            index.remove_replica(replica)
            model.pop(replica, None)
            capacity.pop(replica, None)
        else:
            index.resize(replica, arg[0])
            capacity[replica] = arg[0]
            lru = model.setdefault(replica, [])
            del lru[: max(0, len(lru) - arg[0])]

    expected = {}
    for replica, lru in model.items():
        n = 0
        while n < len(probe) and probe[n] in lru:
            n += 1
        assert index.match(replica, probe) == n
        if n:
            expected[replica] = n
    assert index.match_all(probe) == expected
    assert index.distinct_blocks() == len({b for lru in model.values() for b in lru})
