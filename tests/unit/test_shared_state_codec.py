"""Shared routing state without a Redis: the wire format, the hot-path buffer, the choice of backend, and what a
gateway does when its Redis cannot be reached at all (a closed port)."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

import pytest

from policies.snapshot import RoutingRequest
from pools.shared_state import (
    LocalState,
    RedisState,
    build_shared_state,
    decode_batch,
    encode_batch,
    encode_dispatch,
)


def _noop_apply(pool: str, replica: str, request: RoutingRequest) -> None:
    raise AssertionError("nothing should be applied")


def _closed_port() -> int:
    """A loopback port nobody listens on (bound then released; connecting to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _round_trip(*dispatches: tuple[str, str, RoutingRequest], max_blocks: int = 256
                ) -> list[tuple[str, str, RoutingRequest]]:
    return decode_batch(encode_batch([encode_dispatch(p, r, q, max_blocks) for p, r, q in dispatches]))


def test_a_batch_of_dispatches_round_trips_through_the_wire_format() -> None:
    hashes = tuple((i * 0x9E3779B97F4A7C15) % 2**64 for i in range(40))  # full 64-bit unsigned values
    one = ("interactive", "http://10.0.0.5:8000", RoutingRequest(5000, 4096, hashes, "agent-7"))
    two = ("long", "http://10.0.0.6:8000", RoutingRequest(90_000, 1, (), None))
    three = ("interactive", "http://10.0.0.5:8000", RoutingRequest(1, 2, (5,), "ünïcode-séssion"))
    assert _round_trip(one, two, three) == [one, two, three]
    record = encode_dispatch(*one)
    assert len(record) < 8 * 40 + 80  # packed, not text: 8 bytes a hash plus a small header


def test_only_the_leading_blocks_travel() -> None:
    [(_, _, decoded)] = _round_trip(("p", "http://r", RoutingRequest(9000, 100, tuple(range(1000)), None)))
    assert decoded.block_hashes == tuple(range(256))


def test_signed_and_empty_hashes_and_empty_session_round_trip() -> None:
    for request in (RoutingRequest(10, 1, (-1, 2, -(2**63)), None), RoutingRequest(10, 1, (), ""),
                    RoutingRequest(10, 1, (2**64 - 1,), None)):
        assert _round_trip(("p", "http://r", request)) == [("p", "http://r", request)]


def test_hashes_wider_than_64_bits_are_dropped_not_raised() -> None:
    [(_, _, decoded)] = _round_trip(("p", "http://r", RoutingRequest(10, 1, (2**70,), "s")))
    assert decoded.block_hashes == () and decoded.session_key == "s"


def test_malformed_batches_are_rejected() -> None:
    blob = encode_batch([encode_dispatch("p", "http://r", RoutingRequest(1, 1, (1, 2), None))])
    for bad in (blob[:-3], b"\x09" + blob[1:], b""):
        with pytest.raises((ValueError, struct.error)):
            decode_batch(bad)


def test_backend_follows_the_state_url() -> None:
    def counts() -> dict[str, int]:
        return {}

    assert isinstance(build_shared_state(None, _noop_apply, counts), LocalState)
    assert isinstance(build_shared_state("memory", _noop_apply, counts), LocalState)
    redis_state = build_shared_state("redis://127.0.0.1:6379/7", _noop_apply, counts, model="M/x")
    assert isinstance(redis_state, RedisState)
    assert redis_state.stream_key == "m3gate:M/x:dispatch"
    with pytest.raises(ValueError, match="scheme"):
        build_shared_state("http://127.0.0.1:6379", _noop_apply, counts)


def test_on_dispatch_only_buffers_and_the_buffer_is_bounded() -> None:
    state = RedisState("redis://127.0.0.1:1/0", _noop_apply, dict, max_buffer=100)
    request = RoutingRequest(100, 10, (1, 2, 3), None)
    for i in range(250):
        state.on_dispatch("p", f"http://r{i}", request)
    assert state.buffered == 100
    assert state.counters.entries_dropped == 150
    assert [entry[1] for entry in state._buffer][:2] == ["http://r150", "http://r151"]  # the newest are kept


async def test_unreachable_redis_never_raises_logs_once_and_stays_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="m3gate.shared_state")
    state = RedisState(
        f"redis://127.0.0.1:{_closed_port()}/0", _noop_apply, lambda: {"http://r": 3},
        max_buffer=64, backoff_initial_s=0.02, backoff_max_s=0.05, flush_interval_s=0.01,
    )
    await state.start()  # must not raise
    try:
        assert state.available is False
        request = RoutingRequest(100, 10, tuple(range(50)), "s")
        for _round in range(20):  # requests keep flowing while the background tasks retry
            for _ in range(100):
                state.on_dispatch("p", "http://r", request)
            assert state.remote_in_flight("http://r") == 0
            await asyncio.sleep(0.02)
        assert state.buffered <= 64
        assert state.counters.errors >= 3  # it kept retrying...
        assert state.available is False
    finally:
        await state.stop()
    outage_lines = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(outage_lines) == 1  # ...but said so once
    assert state.counters.disconnects == 1
