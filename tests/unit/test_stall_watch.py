"""The stall watch (gateway/migration/) cuts a stream whose replica went silent, and only then: time the relay
spends waiting on a slow client is not the replica's silence, and one failed health probe (a busy replica's slow
/health) is no sign of a dead replica. Its check runs on a clock passed in."""

from __future__ import annotations

from typing import Any

from gateway.migration import StallWatch
from gateway.relay import Held, SseFilter
from pools.replicas import Replica


class _Response:
    """What the watch closes: the relay's read of the replica's stream."""

    closed = False

    def close(self) -> None:
        self.closed = True


def _entry(watch: StallWatch, replica: Replica, timeout: float = 10.0) -> tuple[list[Any], SseFilter, Held]:
    filt, held = SseFilter(False), Held(replica.guard(1))
    held.response = _Response()  # type: ignore[assignment]
    return [filt, held, replica, timeout, filt.events, 0.0, 0.0], filt, held


def test_a_relay_waiting_on_a_slow_client_is_not_cut_however_long() -> None:
    watch = StallWatch(probe_interval_s=1.0)
    entry, filt, held = _entry(watch, Replica(url="http://a", pool="p"), timeout=1.5)
    filt.waiting = True  # the relay is inside `send`: the client reads slowly
    for now in (1.0, 5.0, 60.0):
        watch.check(entry, now)
    assert not held.response.closed and filt.failure is None  # type: ignore[union-attr]
    filt.waiting = False  # the client took it: the silence counts from here
    watch.check(entry, 61.0)
    assert not held.response.closed  # type: ignore[union-attr]
    watch.check(entry, 62.6)
    assert held.response.closed and filt.failure == "stall"  # type: ignore[union-attr]


def test_one_failed_health_probe_cuts_nothing_two_in_a_row_do() -> None:
    replica = Replica(url="http://a", pool="p")
    watch = StallWatch(probe_interval_s=2.0)
    entry, filt, held = _entry(watch, replica)
    replica.healthy = False  # one /health probe timed out
    watch.check(entry, 1.5)
    watch.check(entry, 3.0)
    assert not held.response.closed  # type: ignore[union-attr]
    watch.check(entry, 3.6)  # unhealthy for longer than a probe interval: the next probe failed too
    assert held.response.closed and filt.failure == "stall"  # type: ignore[union-attr]


def test_a_probe_that_passes_again_restarts_the_count() -> None:
    replica = Replica(url="http://a", pool="p")
    watch = StallWatch(probe_interval_s=2.0)
    entry, _, held = _entry(watch, replica)
    replica.healthy = False
    watch.check(entry, 1.5)
    replica.healthy = True
    watch.check(entry, 2.0)
    replica.healthy = False
    watch.check(entry, 3.0)
    watch.check(entry, 4.5)
    assert not held.response.closed  # type: ignore[union-attr]


def test_an_ejected_replica_s_silent_stream_is_cut_at_once() -> None:
    replica = Replica(url="http://a", pool="p")
    replica.ejected_until = 100.0
    watch = StallWatch(probe_interval_s=2.0)
    entry, filt, held = _entry(watch, replica)
    watch.check(entry, 1.2)
    assert held.response.closed and filt.failure == "stall"  # type: ignore[union-attr]
