"""The background lane: its AIMD window, the headroom gate, the foreground latency it reads, the config rules, and the
admission controller admitting background work only into headroom and growing / cutting its window — on a fake
clock."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from gateway.admission import AdmissionControl, TrafficControl
from gateway.record import RequestRecord
from policies.background import (
    DECREASE_HOLD_S,
    RECOVER_S,
    LATENCY_WINDOW_S,
    BackgroundWindow,
    ForegroundLatency,
    has_headroom,
    lane_limits,
)
from policies.config import GatewayConfig, TrafficClassConfig, TrafficConfig
from tests.unit.test_admission import FakeClient, FakeClock, _settle


# the window ----------------------------------------------------------------------------------------------------------

def test_the_window_grows_by_one_per_success_only_while_in_use_up_to_its_ceiling() -> None:
    window = BackgroundWindow(ceiling=3)
    window.succeeded(in_flight_before=0)  # the lane was idle: nothing learnt
    assert window.limit() == 1
    for expected in (2, 3, 3):
        window.succeeded(in_flight_before=window.limit())
        assert window.limit() == expected


def test_the_window_halves_on_congestion_once_per_hold_never_below_one() -> None:
    window = BackgroundWindow(size=16.0, ceiling=64)
    assert window.congested(100.0) and window.limit() == 8
    assert not window.congested(100.0 + DECREASE_HOLD_S / 2)  # the same burst of signals
    assert window.limit() == 8
    assert window.congested(100.0 + DECREASE_HOLD_S)
    assert window.limit() == 4
    for i in range(5):
        window.congested(200.0 + i * DECREASE_HOLD_S)
    assert window.limit() == 1 and window.decreases == 7


def test_after_a_cut_each_quiet_recovery_step_wins_back_half_the_gap() -> None:
    window = BackgroundWindow(size=16.0, ceiling=16)
    window.congested(0.0)
    window.congested(DECREASE_HOLD_S)  # two cuts of one burst: 16 → 8 → 4, the aim stays 16
    assert window.limit() == 4
    window.recover(DECREASE_HOLD_S + RECOVER_S / 2)  # too soon after the last cut
    assert window.limit() == 4
    sizes = []
    for step in range(1, 6):
        window.recover(DECREASE_HOLD_S + step * RECOVER_S)
        sizes.append(window.limit())
    assert sizes == [10, 13, 15, 16, 16]  # ceil(4 + 12/2), ceil(10 + 6/2), ... then regained: no further aim
    assert window.before_cut == 0.0
    window.recover(100.0)
    assert window.limit() == 16  # recovery never grows past the size before the cut


def test_a_reload_lowers_the_ceiling_and_the_window_with_it() -> None:
    window = BackgroundWindow(size=10.0, ceiling=16)
    window.resize(4)
    assert window.limit() == 4 and window.size == 4.0


# what headroom means -------------------------------------------------------------------------------------------------

def test_headroom_needs_no_foreground_waiting_no_pressure_and_latency_on_target() -> None:
    bg = {"batch"}
    assert has_headroom([], bg, pressure=False, latency_ok=True)
    assert has_headroom(["batch"], bg, pressure=False, latency_ok=True)  # only background waits
    assert not has_headroom(["batch", "interactive"], bg, pressure=False, latency_ok=True)
    assert not has_headroom([], bg, pressure=True, latency_ok=True)
    assert not has_headroom([], bg, pressure=False, latency_ok=False)


def test_lane_limits_cap_background_classes_by_window_or_zero_without_headroom() -> None:
    limits = {"interactive": 8, "batch": 16}
    windows = {"batch": BackgroundWindow(size=3.0, ceiling=16)}
    assert lane_limits(limits, windows, {"batch"}, headroom=True) == {"interactive": 8, "batch": 3}
    assert lane_limits(limits, windows, {"batch"}, headroom=False) == {"interactive": 8, "batch": 0}
    assert limits == {"interactive": 8, "batch": 16}  # not changed in place


def test_foreground_latency_is_the_recent_p95_against_target() -> None:
    latency = ForegroundLatency()
    assert latency.within_target(0.0)  # nothing observed: nothing says no
    for i in range(19):
        assert not latency.observe(float(i), 0.5, 1.0)
    assert latency.within_target(20.0)
    assert latency.observe(20.0, 3.0, 1.0)  # one miss in 20 is the p95's 5%: still within
    assert latency.within_target(20.0)
    latency.observe(20.0, 3.0, 1.0)  # two in 21: the p95 is a miss
    assert not latency.within_target(20.0)
    assert latency.within_target(21.0 + LATENCY_WINDOW_S)  # forgotten


# config ---------------------------------------------------------------------------------------------------------------

def test_a_background_class_must_come_after_every_foreground_class() -> None:
    TrafficConfig(classes={"chat": TrafficClassConfig(priority=0),
                           "batch": TrafficClassConfig(priority=5, background=True)})
    with pytest.raises(ValidationError, match=r"background class\(es\) \['batch'\] need a priority after"):
        TrafficConfig(classes={"chat": TrafficClassConfig(priority=5),
                               "batch": TrafficClassConfig(priority=5, background=True)})
    with pytest.raises(ValidationError, match="every traffic class is background"):
        TrafficConfig(classes={"batch": TrafficClassConfig(priority=5, background=True)})
    with pytest.raises(ValidationError, match="latency_class 'batch' is a background class"):
        TrafficConfig(classes={"chat": TrafficClassConfig(priority=0),
                               "batch": TrafficClassConfig(priority=5, background=True)}, latency_class="batch")
    with pytest.raises(ValidationError):
        TrafficClassConfig(max_pauses=-1)


# through the admission controller -------------------------------------------------------------------------------------

def _lane(pressure: dict[str, bool], clock: FakeClock, ceiling: int = 4) -> AdmissionControl:
    classes = {"chat": TrafficClassConfig(priority=0, max_concurrency=1, queue_length=8),
               "batch": TrafficClassConfig(priority=9, max_concurrency=ceiling, queue_length=16, background=True)}
    return AdmissionControl(TrafficConfig(classes=classes), clock, lambda pool: False, lambda pool: pressure[pool])


async def test_background_waits_while_foreground_waits_and_goes_once_it_is_served() -> None:
    clock, pressure = FakeClock(), {"p": False}
    ctl = _lane(pressure, clock)
    _, chat = await ctl.admit(FakeClient().receive, ["p"], "chat", 0, "k")
    waiting_chat = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "chat", 0, "k"))
    await _settle()
    batch = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k"))
    await _settle()
    assert not batch.done()  # a foreground class waits in the pool: no headroom
    chat.release()
    _, chat2 = await asyncio.wait_for(waiting_chat, 1)
    _, bg = await asyncio.wait_for(batch, 1)  # the foreground queue emptied: the lane opens
    assert ctl.gates["p"].in_flight["batch"] == 1
    chat2.release(), bg.release()


async def test_background_in_flight_is_bounded_by_its_window_which_grows_on_success() -> None:
    clock, pressure = FakeClock(), {"p": False}
    ctl = _lane(pressure, clock)
    _, first = await ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k")
    second = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k"))
    await _settle()
    assert not second.done()  # the window starts at one
    ctl.lane_ended("p", "batch", ok=True, refused=False)  # it ended well while the window was full
    first.release()
    _, second_ticket = await asyncio.wait_for(second, 1)
    assert ctl.gates["p"].windows["batch"].limit() == 2
    _, third = await ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k")  # two may run now
    assert ctl.gates["p"].in_flight["batch"] == 2
    ctl.lane_ended("p", "batch", ok=False, refused=True)  # a replica refused one: halved
    assert ctl.lane_view() == [("p", "batch", 1)]
    second_ticket.release(), third.release()


async def test_a_saturated_replica_stops_the_lane_and_cuts_the_window_of_running_work() -> None:
    clock, pressure = FakeClock(), {"p": False}
    ctl = _lane(pressure, clock, ceiling=8)
    ctl._gate("p").window("batch", 8).size = 6.0
    _, running = await ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k")
    pressure["p"] = True
    ctl._watch_lane("p", ctl.gates["p"])  # what the ticker does every TICK_S
    assert ctl.gates["p"].windows["batch"].limit() == 3
    waiting = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k"))
    await _settle()
    assert not waiting.done()  # no headroom while a replica is saturated, whatever the window
    pressure["p"] = False
    clock.now += 0.1
    ctl._pump("p")
    _, t = await asyncio.wait_for(waiting, 1)
    t.release(), running.release()


async def test_a_foreground_miss_cuts_the_window_and_its_p95_closes_the_lane() -> None:
    config = GatewayConfig.model_validate({
        "model": "m", "pools": [{"name": "p", "max_model_len": 8192}],
        "traffic": {"classes": {"chat": {"priority": 0, "ttft_target_s": 0.5},
                                "batch": {"priority": 9, "background": True, "max_concurrency": 8}}},
    })
    clock = FakeClock()
    traffic = TrafficControl(config, clock, lambda pool: False, lambda pool: False)
    ctl = traffic.admission
    _, bg = await ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k")
    ctl.gates["p"].windows["batch"].size = 8.0
    _, chat = await ctl.admit(FakeClient().receive, ["p"], "chat", 0, "k")
    record = RequestRecord(api="chat", stream=True, t_arrival=clock.now, traffic_class="chat", status=200,
                           t_first_byte=clock.now + 2.0)  # four times its target
    record.admission_ticket = chat
    traffic.finished(record)
    assert ctl.gates["p"].windows["batch"].limit() == 4
    lane = traffic.view()["pools"]["p"]["background"]["batch"]
    assert lane["window"] == 4 and lane["in_flight"] == 1 and lane["headroom"] is False
    assert traffic.view()["classes"]["batch"]["background"] is True
    waiting = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k"))
    await _settle()
    assert not waiting.done()  # the foreground's recent p95 misses its target: no headroom
    clock.now += 31.0  # the miss is forgotten
    ctl._pump("p")
    _, t = await asyncio.wait_for(waiting, 1)
    t.release(), bg.release()


# pausing --------------------------------------------------------------------------------------------------------------

class FakeStream:
    """A background stream as the lane sees it (gateway/migration/'s Resumer): it counts the pauses asked of it."""

    def __init__(self, replica: str | None = None) -> None:
        self.pauses = 0
        self.replica = replica

    def pause(self) -> bool:
        self.pauses += 1
        return True


async def _running_stream(ctl: AdmissionControl) -> tuple[object, FakeStream]:
    _, ticket = await ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k")
    stream = FakeStream()
    ctl.pausable(ticket, stream)
    return ticket, stream


async def test_a_foreground_request_waiting_on_a_saturated_pool_pauses_background_streams() -> None:
    clock, pressure = FakeClock(), {"p": False}
    saturated = {"p": False}
    classes = {"chat": TrafficClassConfig(priority=0, max_concurrency=8, queue_length=8),
               "batch": TrafficClassConfig(priority=9, max_concurrency=4, background=True, max_pauses=1)}
    ctl = AdmissionControl(TrafficConfig(classes=classes), clock, lambda pool: saturated[pool],
                           lambda pool: pressure[pool])
    ctl._gate("p").window("batch", 4).size = 4.0
    ticket, stream = await _running_stream(ctl)
    pressure["p"] = saturated["p"] = True
    ctl._watch_lane("p", ctl.gates["p"])
    assert stream.pauses == 0  # saturated, but no foreground request waits: nothing to make room for
    chat = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "chat", 0, "k"))
    await _settle()
    ctl._watch_lane("p", ctl.gates["p"])
    assert stream.pauses == 1
    hold = asyncio.ensure_future(ctl.paused(ticket))  # what the paused stream does: its slot goes back, it waits
    await _settle()
    assert ctl.gates["p"].in_flight.get("batch", 0) == 0 and not hold.done()
    assert ctl.paused_streams("p", "batch") == 1
    newcomer = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k"))
    pressure["p"] = saturated["p"] = False
    clock.now += 2.0
    ctl._pump("p")  # the foreground goes first, then the paused stream, then the newcomer (window: 4, halved once)
    _, chat_ticket = await asyncio.wait_for(chat, 1)
    await asyncio.wait_for(hold, 1)
    assert ticket.holds_slot and ctl.counters["paused"] == 1
    _, late = await asyncio.wait_for(newcomer, 1)
    assert ctl.gates["p"].in_flight["batch"] == 2
    pressure["p"] = saturated["p"] = True
    again = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "chat", 0, "k"))
    await _settle()
    ctl._watch_lane("p", ctl.gates["p"])
    assert stream.pauses == 1  # max_pauses: 1, it runs to the end now
    for t in (ticket, late, chat_ticket):
        t.release()
    again.cancel()


async def test_a_paused_stream_whose_client_leaves_holds_no_slot_and_no_place() -> None:
    clock, pressure = FakeClock(), {"p": False}
    ctl = _lane(pressure, clock)
    ticket, _ = await _running_stream(ctl)
    pressure["p"] = True
    hold = asyncio.ensure_future(ctl.paused(ticket))
    await _settle()
    hold.cancel()
    await _settle()
    assert not ctl._paused["p"] and ctl.gates["p"].in_flight.get("batch", 0) == 0
    ticket.release()  # its request ends: nothing more is freed
    assert ctl.gates["p"].in_flight.get("batch", 0) == 0 and not ctl._streams["p"]


async def test_a_paused_stream_goes_on_after_its_longest_wait_whatever_the_lane_says() -> None:
    clock, pressure = FakeClock(), {"p": True}
    classes = {"chat": TrafficClassConfig(priority=0),
               "batch": TrafficClassConfig(priority=9, background=True, max_queue_wait_s=0.05)}
    ctl = AdmissionControl(TrafficConfig(classes=classes), clock, lambda pool: False, lambda pool: pressure[pool])
    pressure["p"] = False
    ticket, _ = await _running_stream(ctl)
    pressure["p"] = True  # no headroom from here on
    await asyncio.wait_for(ctl.paused(ticket), 1)
    assert ticket.holds_slot and ctl.gates["p"].in_flight["batch"] == 1
    ticket.release()


def _lane_with_streams(full: dict[str, bool]) -> tuple[AdmissionControl, FakeClock]:
    clock = FakeClock()
    classes = {"chat": TrafficClassConfig(priority=0, max_concurrency=8, queue_length=8),
               "batch": TrafficClassConfig(priority=9, max_concurrency=8, background=True, max_pauses=1)}
    ctl = AdmissionControl(TrafficConfig(classes=classes), clock, lambda pool: False, lambda pool: False,
                           lambda pool: full[pool])
    ctl._gate("p").window("batch", 8).size = 8.0
    return ctl, clock


async def test_a_foreground_request_sent_to_a_full_replica_pauses_one_background_stream_there() -> None:
    ctl, _ = _lane_with_streams({"p": False})
    streams = []
    for url in ("http://a", "http://a", "http://b"):
        _, ticket = await ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k")
        stream = FakeStream(url)
        ctl.pausable(ticket, stream)
        streams.append(stream)
    assert not ctl.make_room("p", "http://a", in_flight=2, full_at=2)  # it still had a slot
    assert not ctl.make_room("p", "http://a", in_flight=3, full_at=0)  # never seen full: nothing known
    assert ctl.make_room("p", "http://a", in_flight=3, full_at=2)
    assert sorted(s.pauses for s in streams[:2]) == [0, 1] and streams[2].pauses == 0  # one, on the full replica
    assert ctl.make_room("p", "http://a", in_flight=4, full_at=2)
    assert [s.pauses for s in streams] == [1, 1, 0]
    assert not ctl.make_room("p", "http://a", in_flight=5, full_at=2)  # max_pauses used: they run to the end
    assert ctl.counters["paused_for_arrival"] == 2


async def test_no_background_request_goes_while_every_replica_batch_is_full() -> None:
    full = {"p": True}
    ctl, clock = _lane_with_streams(full)
    waiting = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k"))
    await _settle()
    assert not waiting.done()  # it would only wait in vLLM's queue, ahead of the next foreground request
    assert ctl.gates["p"].windows["batch"].limit() == 8  # a full batch is no congestion: the window stays
    full["p"] = False
    clock.now += 0.1
    ctl._pump("p")
    _, ticket = await asyncio.wait_for(waiting, 1)
    ticket.release()


async def test_pressure_just_after_a_pause_for_an_arrival_cuts_no_window() -> None:
    """The paused stream's slot frees a moment after the foreground request reached vLLM: its queue shows that
    request meanwhile, which is no congestion; pressure that outlasts MADE_ROOM_GRACE_S is."""
    from gateway.admission import MADE_ROOM_GRACE_S

    pressure = {"p": False}
    clock = FakeClock()
    classes = {"chat": TrafficClassConfig(priority=0, max_concurrency=8, queue_length=8),
               "batch": TrafficClassConfig(priority=9, max_concurrency=8, background=True, max_pauses=3)}
    ctl = AdmissionControl(TrafficConfig(classes=classes), clock, lambda pool: False, lambda pool: pressure[pool])
    ctl._gate("p").window("batch", 8).size = 8.0
    for _ in range(2):
        _, ticket = await ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k")
        ctl.pausable(ticket, FakeStream("http://a"))
    assert ctl.make_room("p", "http://a", in_flight=3, full_at=2)
    pressure["p"] = True
    ctl._watch_lane("p", ctl.gates["p"])
    assert ctl.gates["p"].windows["batch"].limit() == 8
    clock.now += MADE_ROOM_GRACE_S
    ctl._watch_lane("p", ctl.gates["p"])
    assert ctl.gates["p"].windows["batch"].limit() == 4


def test_a_pools_max_num_seqs_is_each_replicas_batch_size_from_the_start() -> None:
    from policies.config import PoolConfig
    from pools.replicas import PoolRuntime

    stated = PoolRuntime.from_config(PoolConfig(name="p", max_model_len=8192, max_num_seqs=8,
                                                endpoints=["http://a:8000", "http://b:8000"]))
    assert [r.batch_full_at for r in stated.replicas.values()] == [8.0, 8.0]
    learnt = PoolRuntime.from_config(PoolConfig(name="p", max_model_len=8192, endpoints=["http://a:8000"]))
    assert [r.batch_full_at for r in learnt.replicas.values()] == [0.0]  # learnt from the metrics
    with pytest.raises(ValidationError):
        PoolConfig(name="p", max_model_len=8192, max_num_seqs=0)
