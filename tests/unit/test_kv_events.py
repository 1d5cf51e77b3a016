"""KV-event decoding (both msgpack layouts) and the subscriber's protocol against a vLLM-like publisher on loopback:
live batches, gaps closed by replay, a buffer that no longer holds the gap, restarts, broken replays and payloads
(the replica's exact view goes stale, routing falls back), AllBlocksCleared, and replicas leaving the hub."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from pools.exact_index import ExactIndex
from pools.kv_events.decoding import AllBlocksCleared, BlockRemoved, BlockStored, KvEventDecodeError, decode_batch
from pools.kv_events.hub import KvEventHub
from pools.kv_events.sources import (
    KvEventSource,
    ReplicaEvents,
    resolve_endpoint,
    sources_from_config,
    sources_from_discovery,
)
from pools.kv_events.subscriber import SourceSubscriber, SubscriberSettings

URL = "http://127.0.0.1:8000"
BIG = (1 << 64) - 5  # block hashes are u64: above int64


def stored(hashes: list[int], parent: int | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": [1] * 4,
            "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def removed(hashes: list[int], **extra: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **extra}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def pack(events: list[Any], rank: int | None = 0) -> bytes:
    return msgpack.packb([1700000000.5, events, rank] if rank is not None else [1700000000.5, events])


# ---------------------------------------------------------------------------------------------------------------
# decoding


def test_decodes_the_map_tagged_layout_of_vllm_0_32() -> None:
    digest = bytes(range(32))
    batch = decode_batch(pack([
        stored([BIG, digest], parent=7, extra_keys=[None, None], group_idx=0, session_id="s"),  # optional fields
        removed([BIG]),
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [], "block_size": 4,
         "lora_id": None, "medium": "CPU", "lora_name": None},  # offload tier
        cleared(),
        {"type": "SomethingNewer", "x": 1},
    ], rank=2))
    assert batch.data_parallel_rank == 2 and batch.skipped == 1
    first, second, third, fourth = batch.events
    assert first == BlockStored((BIG, int.from_bytes(digest[-8:], "big")), 7, 4, "GPU", 0)
    assert second == BlockRemoved((BIG,), "GPU")
    assert isinstance(third, BlockStored) and third.medium == "CPU"
    assert isinstance(fourth, AllBlocksCleared)


def test_decodes_the_older_array_layout() -> None:
    batch = decode_batch(pack([
        ["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"],
        ["BlockRemoved", [11], "GPU"],
        ["AllBlocksCleared"],
    ], rank=None))
    assert batch.events == (BlockStored((11, 12), None, 4, "GPU", token_ids=(1, 2, 3, 4, 5, 6, 7, 8)),
                            BlockRemoved((11,), "GPU"), AllBlocksCleared())  # a root keeps its tokens (hash check)
    assert batch.data_parallel_rank is None


def test_decodes_a_map_batch_and_refuses_garbage() -> None:
    batch = decode_batch(msgpack.packb({"ts": 1.0, "events": [stored([5])], "data_parallel_rank": 0}))
    assert batch.events[0] == BlockStored((5,), None, 4, "GPU", token_ids=(1, 1, 1, 1))
    for bad in (b"\xc1", msgpack.packb(3), msgpack.packb([1.0, 5]), pack([stored(["x"])]), pack([42])):
        with pytest.raises(KvEventDecodeError):
            decode_batch(bad)


def test_endpoints_from_config_and_discovery() -> None:
    assert resolve_endpoint("tcp://*:5557", "http://10.0.0.5:8000") == "tcp://10.0.0.5:5557"
    assert resolve_endpoint("tcp://0.0.0.0:5557", "http://10.0.0.5:8000", rank=2) == "tcp://10.0.0.5:5559"
    assert resolve_endpoint("tcp://*:5557", "http://[fd00::1]:8000") == "tcp://[fd00::1]:5557"
    assert resolve_endpoint("tcp://10.9.9.9:5557", "http://10.0.0.5:8000") == "tcp://10.9.9.9:5557"
    srcs = sources_from_config(ReplicaEvents(URL, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5559",
                                             topic="kv", data_parallel_size=2))
    assert [(s.key, s.endpoint, s.replay_endpoint) for s in srcs] == [
        (URL, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559"),
        (URL + "#dp1", "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5560"),
    ]
    found = sources_from_discovery("http://10.0.0.5:8000", {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:41000",
              "replay_endpoint": "tcp://*:41001", "topic": "kv"},
        "1": {"enable_kv_cache_events": True, "publisher": "null", "endpoint": "tcp://*:41002"},
    })
    assert found == [KvEventSource("http://10.0.0.5:8000", "http://10.0.0.5:8000", "tcp://10.0.0.5:41000",
                                   "tcp://10.0.0.5:41001", "kv")]
    assert sources_from_discovery(URL, {}) == [] and sources_from_discovery(URL, None) == []


# ---------------------------------------------------------------------------------------------------------------
# a publisher under the test's control


class FakePublisher:
    """vLLM's ZmqEventPublisher in miniature: PUB + replay ROUTER on loopback with a bounded buffer, plus knobs to
    lose live batches, answer replays in the pre-0.32 framing, or not answer at all."""

    def __init__(self, ctx: zmq.asyncio.Context, *, buffer: int = 100, old_framing: bool = False,
                 answer_replays: bool = True, topic: bytes = b"kv") -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.seq = 0
        self.topic = topic
        self.old_framing = old_framing
        self.answer_replays = answer_replays
        self.replay_requests: list[int] = []
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def publish(self, events: list[Any], *, lose: bool = False, payload: bytes | None = None) -> int:
        seq = self.seq
        self.seq += 1
        data = payload if payload is not None else pack(events)
        self.buffer.append((seq, data))
        if not lose:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])
        return seq

    def restart(self) -> None:
        """A new process: seq from 0, nothing buffered."""
        self.seq = 0
        self.buffer.clear()

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            if not self.answer_replays:
                continue
            for seq, data in list(self.buffer):
                if seq >= start_seq:
                    frames = [client, b"", seq.to_bytes(8, "big"), data] if self.old_framing else \
                        [client, b"", self.topic, seq.to_bytes(8, "big"), data]
                    await self.router.send_multipart(frames)
            end = [client, b"", (-1).to_bytes(8, "big", signed=True), b""]
            await self.router.send_multipart(end if self.old_framing else [client, b"", b"", end[2], b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(0)
        self.router.close(0)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


class Running:
    def __init__(self, sub: SourceSubscriber, task: asyncio.Task[None], index: ExactIndex) -> None:
        self.sub, self.task, self.index = sub, task, index

    def blocks(self) -> dict[str, int]:
        return self.index.match_all(list(range(1, 100)), time.monotonic())


@contextlib.asynccontextmanager
async def subscribed(ctx: zmq.asyncio.Context, pub: FakePublisher, *, replay: bool = True,
                     **settings: Any) -> AsyncIterator[Running]:
    index = ExactIndex(pending_ttl_s=0)
    index.add_source(URL, URL, 1000)
    source = KvEventSource(URL, URL, pub.endpoint, pub.replay_endpoint if replay else None, "kv")
    sub = SourceSubscriber(ctx, source, index, settings=SubscriberSettings(poll_ms=50, **settings))
    task = asyncio.get_running_loop().create_task(sub.run())
    try:
        await until(lambda: sub.synced)
        await asyncio.sleep(0.05)  # the subscription reaches the publisher
        yield Running(sub, task, index)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def held(index: ExactIndex, *hashes: int) -> bool:
    state = index.match_all(list(hashes), time.monotonic())
    return state.get(URL, 0) == len(hashes)


# ---------------------------------------------------------------------------------------------------------------
# the protocol


async def test_live_batches_store_remove_and_clear(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    async with subscribed(ctx, pub) as run:
        assert run.index.fresh(URL, time.monotonic())
        await pub.publish([stored([1, 2, 3])])
        await until(lambda: held(run.index, 1, 2, 3))
        await pub.publish([removed([3]), stored([4], parent=2)])
        await until(lambda: run.sub.stats.last_seq == 1)
        assert run.index.match_all([1, 2, 3], time.monotonic()) == {URL: 2}
        await pub.publish([cleared()])
        await until(lambda: run.index.size(URL) == 0)
        assert run.sub.stats.cleared == 1 and run.sub.stats.gaps == 0 and run.sub.stats.last_seq == 2
        assert run.index.fresh(URL, time.monotonic())
    await pub.close()


async def test_history_before_connecting_is_replayed(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    await pub.publish([stored([1, 2])], lose=True)  # published before anyone listened
    await pub.publish([stored([3], parent=2)], lose=True)
    async with subscribed(ctx, pub) as run:
        assert held(run.index, 1, 2, 3) and pub.replay_requests == [0]
        await pub.publish([stored([4], parent=3)])
        await until(lambda: held(run.index, 1, 2, 3, 4))
        assert run.index.fresh(URL, time.monotonic())
    await pub.close()


async def test_a_gap_is_closed_by_replay(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    async with subscribed(ctx, pub) as run:
        await pub.publish([stored([1])])
        await until(lambda: held(run.index, 1))
        await pub.publish([stored([2], parent=1), removed([1])], lose=True)  # lost on the way (e.g. over the hwm)
        await pub.publish([stored([3], parent=2)])
        await until(lambda: run.index.size(URL) == 2)
        assert run.index.match_all([1], time.monotonic()) == {}  # the lost BlockRemoved was applied too
        assert run.sub.stats.gaps == 1 and pub.replay_requests[-1] == 1
        await pub.publish([stored([4], parent=3)])  # back in sequence; replayed duplicates were skipped
        await until(lambda: run.index.size(URL) == 3)
        assert run.sub.stats.restarts == 0 and run.index.fresh(URL, time.monotonic())
    await pub.close()


async def test_the_pre_0_32_replay_framing_is_understood(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx, old_framing=True)
    async with subscribed(ctx, pub) as run:
        await pub.publish([stored([1])])
        await pub.publish([stored([2], parent=1)], lose=True)
        await pub.publish([stored([3], parent=2)])
        await until(lambda: held(run.index, 1, 2, 3))
        assert run.sub.stats.replay_failures == 0
    await pub.close()


async def test_a_gap_the_buffer_no_longer_holds_rebuilds_and_falls_back(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx, buffer=2)
    async with subscribed(ctx, pub, stale_after_failure_s=0.4) as run:
        await pub.publish([stored([1])])
        await until(lambda: held(run.index, 1))
        for h in (2, 3, 4):
            await pub.publish([stored([h]), removed([1])] if h == 2 else [stored([h])], lose=True)
        await pub.publish([stored([5])])  # seq 4: 1..3 missing, the buffer keeps only 3 and 4
        await until(lambda: run.index.size(URL) == 2)  # rebuilt from what the buffer had: blocks 4 and 5
        now = time.monotonic()
        assert run.index.stale_reason(URL, now) == "partial_history"  # meanwhile: approximate routing
        assert run.index.match_all([4, 5], now) == {URL: 2} and run.index.match_all([1], now) == {}
        assert run.sub.stats.replay_failures == 1 and run.sub.stats.resyncs == 2
        await until(lambda: run.index.fresh(URL, time.monotonic()), timeout=2)
    await pub.close()


async def test_a_publisher_restart_empties_the_replica(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    async with subscribed(ctx, pub) as run:
        await pub.publish([stored([1, 2])])
        await pub.publish([stored([3], parent=2)])
        await until(lambda: held(run.index, 1, 2, 3))
        pub.restart()  # same sockets, new process: seq from 0, an empty cache
        await pub.publish([stored([7])])
        await until(lambda: run.sub.stats.restarts == 1 and held(run.index, 7))
        assert run.index.match_all([1], time.monotonic()) == {} and run.index.size(URL) == 1
    await pub.close()


async def test_an_unanswered_replay_marks_the_replica_stale_then_follows_live(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx, answer_replays=False)
    async with subscribed(ctx, pub, replay_timeout_s=0.2, stale_after_failure_s=60) as run:
        assert run.index.stale_reason(URL, time.monotonic()) == "replay_failed"
        await pub.publish([stored([1])])
        await until(lambda: held(run.index, 1))  # still learning, but not trusted for routing yet
        assert not run.index.fresh(URL, time.monotonic())
    await pub.close()


async def test_without_a_replay_endpoint_a_gap_means_stale(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    async with subscribed(ctx, pub, replay=False, stale_after_failure_s=60) as run:
        assert run.index.stale_reason(URL, time.monotonic()) == "no_replay"  # history before connecting unknown
        await pub.publish([stored([1])])
        await until(lambda: held(run.index, 1))
        await pub.publish([removed([1])], lose=True)
        await pub.publish([stored([2])])
        await until(lambda: held(run.index, 2))
        assert run.index.match_all([1], time.monotonic()) == {}  # emptied: the lost removal cannot leave a phantom
        assert run.sub.stats.gaps == 1
    await pub.close()


async def test_an_undecodable_batch_distrusts_the_replica(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    async with subscribed(ctx, pub, stale_after_failure_s=60) as run:
        await pub.publish([stored([1])])
        await until(lambda: held(run.index, 1))
        await pub.publish([], payload=b"\xc1not msgpack")
        await until(lambda: run.sub.stats.decode_errors == 1)
        assert run.index.size(URL) == 0 and run.index.stale_reason(URL, time.monotonic()) == "decode_error"
    await pub.close()


async def test_the_hub_follows_the_replica_set_and_frees_removed_ones(ctx: zmq.asyncio.Context) -> None:
    pubs = [FakePublisher(ctx), FakePublisher(ctx)]
    urls = ["http://127.0.0.1:1001", "http://127.0.0.1:1002"]
    index = ExactIndex(pending_ttl_s=0)
    hub = KvEventHub(index, settings=SubscriberSettings(poll_ms=50))

    def target(url: str, pub: FakePublisher) -> ReplicaEvents:
        return ReplicaEvents(url, "p", 100, endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, topic="kv")

    hub.sync({u: target(u, p) for u, p in zip(urls, pubs)})
    await hub.start()
    try:
        await until(lambda: all(index.fresh(u, time.monotonic()) for u in urls))
        await asyncio.sleep(0.05)
        for p in pubs:
            await p.publish([stored([1, 2])])
        await until(lambda: index.match_all([1, 2], time.monotonic()) == {urls[0]: 2, urls[1]: 2})
        hub.sync({urls[0]: target(urls[0], pubs[0])})  # the second replica left the pool
        assert index.replicas() == [urls[0]] and index.size(urls[1]) == 0 and hub.replicas() == [urls[0]]
        assert index.distinct_blocks() == 2
        stats = hub.stats()
        assert list(stats) == [urls[0]] and stats[urls[0]]["stored"] == 2
    finally:
        await hub.stop()
        for p in pubs:
            await p.close()


async def test_a_wrapped_buffer_after_a_cache_reset_is_complete_history(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx, buffer=3)
    for h in (1, 2, 3):
        await pub.publish([stored([h])], lose=True)
    await pub.publish([cleared()], lose=True)  # e.g. POST /reset_prefix_cache: earlier batches no longer matter
    await pub.publish([stored([9])], lose=True)
    async with subscribed(ctx, pub, stale_after_failure_s=60) as run:
        assert held(run.index, 9) and run.index.size(URL) == 1
        assert run.index.fresh(URL, time.monotonic())  # no stale window: the history since the reset is whole
    await pub.close()
