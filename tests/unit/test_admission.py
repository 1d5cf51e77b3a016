"""Admission: queue order (priority, then round-robin between keys, then arrival), class limits without head-of-line
blocking, Retry-After from the drain rate, and the async controller's waiting, spilling, refusing and leaving —
all on a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.admission import AdmissionControl, ClientGone, Ticket, TrafficControl
from gateway.record import RequestRecord
from policies.admission import (
    RETRY_AFTER_MAX_S,
    DrainRate,
    FairQueue,
    PoolGate,
    RetryLater,
    Waiter,
    pool_saturated,
    retry_after_s,
)
from policies.snapshot import ReplicaSnapshot
from policies.config import GatewayConfig, SaturationConfig, TrafficClassConfig, TrafficConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _w(cls: str = "interactive", key: str = "", priority: int = 0, t: float = 0.0) -> Waiter:
    return Waiter(cls, key, priority, t)


def _served(queue: FairQueue, n: int | None = None) -> list[Waiter]:
    """Serve the queue in order, as admission does, and return who went in which order."""
    out = []
    while len(queue) and (n is None or len(out) < n):
        first = next(iter(queue))
        queue.serve(first)
        out.append(first)
    return out


# FairQueue -----------------------------------------------------------------------------------------------------

def test_lower_priority_value_is_served_first_then_arrival() -> None:
    q = FairQueue()
    late_batch = [_w("repository", "k", 1, t) for t in range(3)]
    early_interactive = _w("interactive", "k", 0, 5)
    for w in late_batch:
        q.push(w)
    q.push(early_interactive)
    assert _served(q) == [early_interactive, *late_batch]


def test_round_robin_between_keys_within_a_priority_level() -> None:
    q = FairQueue()
    burst = [_w(key="bulk", t=t) for t in range(5)]
    for w in burst:
        q.push(w)
    alice, bob = _w(key="alice", t=10), _w(key="bob", t=11)
    q.push(alice)
    q.push(bob)
    order = _served(q)
    # the burst's first request arrived first; then each key gets a turn before the burst's second one
    assert order[:3] == [burst[0], alice, bob]
    assert order[3:] == burst[1:]


def test_fairness_continues_after_some_are_served() -> None:
    q = FairQueue()
    for t in range(4):
        q.push(_w(key="bulk", t=t))
    assert _served(q, 2)[0].fairness_key == "bulk"
    q.push(_w(key="late", t=20))
    # a key arriving after two rounds joins the current round: behind the burst's request of this round (it came
    # first), ahead of the rest of the burst
    assert [w.fairness_key for w in _served(q)] == ["bulk", "late", "bulk"]


def test_interleaving_is_strict_round_robin_for_equal_bursts() -> None:
    q = FairQueue()
    for t in range(3):
        q.push(_w(key="a", t=t))
    for t in range(3):
        q.push(_w(key="b", t=10 + t))
    assert [w.fairness_key for w in _served(q)] == ["a", "b", "a", "b", "a", "b"]


def test_remove_frees_the_place_and_counts() -> None:
    q = FairQueue()
    a, b, c = _w(key="x", t=0), _w("repository", key="y", t=1), _w(key="x", t=2)
    for w in (a, b, c):
        q.push(w)
    assert q.queued("interactive") == 2 and len(q) == 3
    assert q.remove(a)
    assert not q.remove(a)  # idempotent: a waiter can only leave once
    assert q.queued("interactive") == 1 and len(q) == 2
    assert list(q) == [c, b] or list(q) == [b, c]
    assert set(_served(q)) == {b, c}


def test_ahead_counts_waiters_of_equal_or_better_priority() -> None:
    q = FairQueue()
    for prio in (0, 0, 1, 2, 2):
        q.push(_w(priority=prio))
    assert q.ahead(0) == 2
    assert q.ahead(1) == 3
    assert q.ahead(5) == 5


# PoolGate --------------------------------------------------------------------------------------------------------

def test_class_limits_do_not_block_other_classes() -> None:
    gate = PoolGate()
    limits = {"interactive": 2, "repository": 1}
    gate.take_slot("repository")  # repository is full
    long_jobs = [_w("repository", priority=1) for _ in range(3)]
    for w in long_jobs:
        gate.queue.push(w)
    chat = _w("interactive", priority=0)
    gate.queue.push(chat)
    assert gate.admit_waiting(limits, saturated=False) == [chat]
    assert gate.queue.queued("repository") == 3
    gate.free_slot("repository", now=1.0)
    assert gate.admit_waiting(limits, saturated=False) == [long_jobs[0]]


def test_saturated_pool_admits_nobody_and_newcomers_do_not_overtake() -> None:
    gate = PoolGate()
    limits = {"interactive": 4}
    waiting = _w()
    gate.queue.push(waiting)
    assert gate.admit_waiting(limits, saturated=True) == []
    assert not gate.has_room("interactive", 4, saturated=False)  # one of its class already waits
    assert not gate.has_room("interactive", 4, saturated=True)
    assert gate.admit_waiting(limits, saturated=False) == [waiting]
    assert gate.has_room("interactive", 4, saturated=False)


def test_waiters_of_a_class_removed_by_reload_are_let_through() -> None:
    gate = PoolGate()
    orphan = _w("gone")
    gate.queue.push(orphan)
    assert gate.admit_waiting({"interactive": 1}, saturated=False) == [orphan]


# Drain rate and Retry-After --------------------------------------------------------------------------------------

def test_retry_after_follows_the_observed_drain_rate() -> None:
    drain = DrainRate()
    assert drain.per_second(0.0) is None
    for i in range(20):  # two slots freed per second for 10 s
        drain.record(i * 0.5)
    rate = drain.per_second(10.0)
    assert rate == pytest.approx(2.0, rel=0.1)
    assert retry_after_s(9, rate, fallback_s=30) == 5  # 10 requests at 2/s
    assert retry_after_s(0, rate, fallback_s=30) == 1  # never 0
    assert retry_after_s(10_000, rate, fallback_s=30) == RETRY_AFTER_MAX_S  # capped
    assert retry_after_s(3, None, fallback_s=7.2) == 8  # nothing drained lately: the configured wait


def test_drain_rate_forgets_old_events() -> None:
    drain = DrainRate()
    drain.record(0.0)
    assert drain.per_second(100.0) is None


# Saturation ---------------------------------------------------------------------------------------------------------

def _snap(waiting: float | None, age: float | None = 0.5, kv: float | None = 0.1,
          healthy: bool = True) -> ReplicaSnapshot:
    return ReplicaSnapshot(url="u", pool="p", healthy=healthy, waiting=waiting, kv_usage=kv, metrics_age_s=age)


def test_pool_is_saturated_only_when_every_available_replica_is() -> None:
    cfg = SaturationConfig(max_waiting=4, max_kv_usage=0.9, stale_after_s=5)
    assert pool_saturated([_snap(4), _snap(9)], cfg)
    assert not pool_saturated([_snap(4), _snap(1)], cfg)
    assert pool_saturated([_snap(0, kv=0.95)], cfg)
    assert not pool_saturated([_snap(9, age=30)], cfg)  # stale metrics say nothing
    assert not pool_saturated([_snap(None, age=None)], cfg)  # never scraped
    assert pool_saturated([_snap(9), _snap(0, healthy=False)], cfg)  # an unhealthy replica does not count
    assert not pool_saturated([_snap(9, healthy=False)], cfg)  # none available: not admission's call


# AdmissionControl (async, fake clock, fake ASGI receive) ------------------------------------------------------------

class FakeClient:
    """An ASGI `receive` that reports a disconnect when told to."""

    def __init__(self) -> None:
        self._gone = asyncio.Event()

    async def receive(self) -> dict[str, str]:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    def disconnect(self) -> None:
        self._gone.set()


def _control(classes: dict[str, TrafficClassConfig], saturated: Callable[[str], bool] = lambda pool: False,
             clock: FakeClock | None = None) -> AdmissionControl:
    return AdmissionControl(TrafficConfig(classes=classes), clock or FakeClock(), saturated)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_queued_request_gets_the_slot_its_predecessor_frees() -> None:
    ctl = _control({"interactive": TrafficClassConfig(max_concurrency=1, queue_length=4)})
    pool, first = await ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k")
    assert pool == "small"
    second = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k"))
    await _settle()
    assert not second.done() and ctl.gates["small"].queue.queued("interactive") == 1
    first.release()
    first.release()  # idempotent: the slot is freed once
    pool, ticket = await asyncio.wait_for(second, 1)
    assert isinstance(ticket, Ticket) and ctl.gates["small"].in_flight["interactive"] == 1
    ticket.release()
    assert ctl.gates["small"].in_flight["interactive"] == 0


async def test_queue_order_through_the_controller_is_priority_then_fair() -> None:
    classes = {"interactive": TrafficClassConfig(priority=0, max_concurrency=1, queue_length=10),
               "repository": TrafficClassConfig(priority=1, max_concurrency=1, queue_length=10)}
    saturated = {"small": True}
    ctl = _control(classes, lambda pool: saturated["small"])
    order: list[str] = []

    async def ask(cls: str, key: str, tag: str, priority: int) -> None:
        _, ticket = await ctl.admit(FakeClient().receive, ["small"], cls, priority, key)
        order.append(tag)
        ticket.release()

    tasks = [asyncio.ensure_future(ask("repository", "bulk", f"bulk{i}", 1)) for i in range(3)]
    await _settle()
    tasks.append(asyncio.ensure_future(ask("repository", "alice", "alice", 1)))
    await _settle()
    tasks.append(asyncio.ensure_future(ask("interactive", "bulk", "chat", 0)))
    await _settle()
    assert order == []  # saturated: everyone waits
    saturated["small"] = False
    ctl._pump("small")
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert order == ["chat", "bulk0", "alice", "bulk1", "bulk2"]


async def test_queue_full_is_a_429_with_a_sane_retry_after() -> None:
    clock = FakeClock()
    ctl = _control({"interactive": TrafficClassConfig(max_concurrency=1, queue_length=1, max_queue_wait_s=30)},
                   clock=clock)
    for _ in range(4):  # two slots freed per second, observed
        _, t = await ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k")
        clock.now += 0.5
        t.release()
    _, held = await ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k")
    waiting = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k"))
    await _settle()
    with pytest.raises(RetryLater) as refused:
        await ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k")
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert 1 <= refused.value.retry_after_s <= 5
    assert "queue" in refused.value.message and "Retry" in refused.value.message
    held.release()
    _, t = await asyncio.wait_for(waiting, 1)
    t.release()


async def test_waiting_longer_than_max_queue_wait_is_a_503_with_retry_after() -> None:
    ctl = _control({"interactive": TrafficClassConfig(max_concurrency=1, queue_length=5, max_queue_wait_s=0.05)})
    _, held = await ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k")
    with pytest.raises(RetryLater) as refused:
        await ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k")
    assert refused.value.status == 503 and refused.value.code == "queue_timeout"
    assert 1 <= refused.value.retry_after_s <= RETRY_AFTER_MAX_S
    assert ctl.gates["small"].queue.queued("interactive") == 0  # it left the queue
    held.release()


async def test_a_client_that_disconnects_while_queued_frees_its_place_at_once() -> None:
    ctl = _control({"interactive": TrafficClassConfig(max_concurrency=1, queue_length=1, max_queue_wait_s=30)})
    _, held = await ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k")
    leaving = FakeClient()
    task = asyncio.ensure_future(ctl.admit(leaving.receive, ["small"], "interactive", 0, "k"))
    await _settle()
    assert ctl.gates["small"].queue.queued("interactive") == 1
    leaving.disconnect()
    with pytest.raises(ClientGone):
        await asyncio.wait_for(task, 1)
    assert ctl.gates["small"].queue.queued("interactive") == 0
    # its place is free: the next one may queue (instead of a 429), and gets the slot when it frees
    nxt = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k"))
    await _settle()
    held.release()
    _, t = await asyncio.wait_for(nxt, 1)
    t.release()
    assert ctl.gates["small"].in_flight["interactive"] == 0


async def test_a_cancelled_waiter_leaves_no_slot_or_place_behind() -> None:
    ctl = _control({"interactive": TrafficClassConfig(max_concurrency=1, queue_length=3, max_queue_wait_s=30)})
    _, held = await ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k")
    task = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k"))
    await _settle()
    held.release()  # grants the waiter its slot...
    task.cancel()  # ...but its handler is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await task
    gate = ctl.gates["small"]
    assert gate.in_flight["interactive"] == 0 and len(gate.queue) == 0


async def test_spill_to_a_larger_pool_with_headroom_else_queue() -> None:
    classes = {"interactive": TrafficClassConfig(max_concurrency=1, queue_length=5)}
    ctl = _control(classes)
    _, a = await ctl.admit(FakeClient().receive, ["small", "large"], "interactive", 0, "k")
    pool, b = await ctl.admit(FakeClient().receive, ["small", "large"], "interactive", 0, "k")
    assert pool == "large"  # small is full, large has room for this class
    third = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["small", "large"], "interactive", 0, "k"))
    await _settle()
    assert ctl.gates["small"].queue.queued("interactive") == 1  # both full: it waits in its own pool
    a.release()
    pool, c = await asyncio.wait_for(third, 1)
    assert pool == "small"
    b.release()
    c.release()
    no_spill = _control({"interactive": TrafficClassConfig(max_concurrency=1, queue_length=0, spill_upward=False)})
    _, held = await no_spill.admit(FakeClient().receive, ["small", "large"], "interactive", 0, "k")
    with pytest.raises(RetryLater) as refused:
        await no_spill.admit(FakeClient().receive, ["small", "large"], "interactive", 0, "k")
    assert refused.value.status == 503 and refused.value.code == "no_capacity"
    held.release()


async def test_replica_saturation_holds_requests_until_it_clears() -> None:
    saturated = {"small": True}
    ctl = _control({"interactive": TrafficClassConfig(max_concurrency=100, queue_length=5)},
                   lambda pool: saturated[pool])
    ctl.start()
    try:
        task = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k"))
        await asyncio.sleep(0.15)
        assert not task.done()
        saturated["small"] = False  # metrics changed: no slot was freed, the ticker notices
        _, t = await asyncio.wait_for(task, 1)
        t.release()
    finally:
        await ctl.stop()


async def test_raising_a_limit_by_reload_lets_waiters_in() -> None:
    ctl = _control({"interactive": TrafficClassConfig(max_concurrency=1, queue_length=5)})
    ctl.start()
    try:
        _, held = await ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k")
        task = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["small"], "interactive", 0, "k"))
        await _settle()
        ctl.apply_config(TrafficConfig(classes={"interactive": TrafficClassConfig(max_concurrency=2)}))
        _, t = await asyncio.wait_for(task, 1)
        t.release()
        held.release()
    finally:
        await ctl.stop()


# TrafficControl's operator view ---------------------------------------------------------------------------------------

async def test_the_traffic_view_shows_slots_waiters_and_ttft_against_target() -> None:
    config = GatewayConfig.model_validate({
        "model": "m", "pools": [{"name": "interactive", "max_model_len": 8192}],
        "traffic": {"classes": {"interactive": {"max_concurrency": 1, "ttft_target_s": 0.5}}},
    })
    clock = FakeClock()
    traffic = TrafficControl(config, clock, lambda pool: False)
    _, ticket = await traffic.admission.admit(FakeClient().receive, ["interactive"], "interactive", 0, "")
    waiting = asyncio.ensure_future(
        traffic.admission.admit(FakeClient().receive, ["interactive"], "interactive", 0, ""))
    await _settle()
    view = traffic.view()
    assert view["open"] and view["rate_limits"] == "memory"
    assert view["pools"]["interactive"]["classes"]["interactive"] == {"in_flight": 1, "queued": 1}
    record = RequestRecord(api="chat", stream=True, t_arrival=clock.now, traffic_class="interactive", status=200,
                           t_first_byte=clock.now + 0.2)
    record.admission_ticket = ticket
    traffic.finished(record)  # frees the slot: the waiter gets it
    _, second = await asyncio.wait_for(waiting, 1)
    second.release()
    view = traffic.view()
    interactive = view["classes"]["interactive"]
    assert interactive["ttft_p95_s"] == pytest.approx(0.2) and interactive["meets_target"] is True
    assert view["counters"]["queued"] == 1 and view["counters"]["admitted"] == 2
