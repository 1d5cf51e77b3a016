"""policies/batch_deadline.py and the lever it acts through: a job on track keeps the lane's own window; one predicted
to miss its completion window gets one share step more per interval, up to the highest; back on track it steps down;
the steps raise the batch window's floor, which the lane still closes whenever the foreground needs the capacity."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from gateway.admission import AdmissionControl
from gateway.batch.runner import BatchRunner
from policies.background import BackgroundWindow, lane_limits
from policies.batch_deadline import Forecast, ShareStep, forecast, lane_floor, measured_rate, next_step
from policies.config import BatchDeadlineConfig, GatewayConfig, TrafficClassConfig, TrafficConfig
from tests.unit.test_admission import FakeClient, FakeClock, _settle

RULE = BatchDeadlineConfig(margin=0.9, on_track=0.6, step_interval_s=10.0, max_step=3, window_per_step=4)


# the forecast ---------------------------------------------------------------------------------------------------------

def test_the_rate_is_measured_only_once_the_samples_span_long_enough() -> None:
    assert measured_rate([(0.0, 0)], 5.0) is None
    assert measured_rate([(0.0, 0), (2.0, 10)], 5.0) is None  # two seconds say too little
    assert measured_rate([(0.0, 0), (5.0, 10), (10.0, 30)], 5.0) == 3.0
    # since its share last changed (t=5): the rate at its current share, once that spans long enough
    assert measured_rate([(0.0, 0), (5.0, 10), (10.0, 30)], 5.0, since=5.0) == 4.0
    assert measured_rate([(0.0, 0), (5.0, 10), (8.0, 30)], 5.0, since=5.0) == pytest.approx(30 / 8)


def test_a_job_on_pace_is_not_at_risk_and_one_behind_is() -> None:
    on_pace = forecast(lines_left=100, rate=2.0, now=1000.0, deadline=1100.0, margin=0.9)  # needs 50 of 100 s
    assert on_pace == Forecast(2.0, 1050.0, 0.5, False)
    behind = forecast(lines_left=100, rate=1.0, now=1000.0, deadline=1100.0, margin=0.9)  # needs all 100 s
    assert behind.at_risk and behind.predicted_finish_at == 1100.0 and behind.needed_share == 1.0
    assert forecast(95, 1.0, 1000.0, 1100.0, 0.9).at_risk  # 95 s of 100: inside the window, not the margin


def test_no_progress_is_at_risk_without_a_finish_and_no_measurement_says_nothing() -> None:
    stalled = forecast(lines_left=10, rate=0.0, now=0.0, deadline=100.0, margin=0.9)
    assert stalled.at_risk and stalled.predicted_finish_at is None and stalled.needed_share == math.inf
    unknown = forecast(lines_left=10, rate=None, now=0.0, deadline=100.0, margin=0.9)
    assert not unknown.at_risk and unknown.predicted_finish_at is None and unknown.needed_share is None
    assert not forecast(lines_left=0, rate=None, now=5.0, deadline=100.0, margin=0.9).at_risk  # all done
    assert forecast(lines_left=1, rate=10.0, now=200.0, deadline=100.0, margin=0.9).at_risk  # past its deadline


# the share step -------------------------------------------------------------------------------------------------------

def _outlook(share: float | None) -> Forecast:
    return Forecast(1.0, None, share, share is not None and share > RULE.margin)


def test_on_track_the_share_stays_where_it_is() -> None:
    assert next_step(ShareStep(), _outlook(0.5), 100.0, RULE) == ShareStep()
    assert next_step(ShareStep(), _outlook(None), 100.0, RULE) == ShareStep()  # not measured yet


def test_behind_the_share_rises_one_step_per_interval_up_to_the_highest() -> None:
    step, now, seen = ShareStep(), 0.0, []
    for _ in range(12):  # a look every 2.5 s, always behind
        step = next_step(step, _outlook(2.0), now, RULE)
        seen.append(step.step)
        now += 2.5
    assert seen == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]  # once per 10 s, never above max_step


def test_back_on_track_the_share_steps_down_and_in_the_band_it_holds() -> None:
    raised = ShareStep(2, 0.0)
    assert next_step(raised, _outlook(0.8), 20.0, RULE) == raised  # between on_track and margin: held
    assert next_step(raised, _outlook(0.5), 5.0, RULE) == raised  # within the interval of the last change
    assert next_step(raised, _outlook(0.5), 20.0, RULE) == ShareStep(1, 20.0)
    assert next_step(ShareStep(1, 20.0), _outlook(0.1), 30.0, RULE) == ShareStep(0, 30.0)


def test_the_floor_follows_the_highest_step_of_the_jobs_run_here() -> None:
    assert lane_floor([], 4) == 0
    assert lane_floor([0, 2, 1], 4) == 8


def test_the_band_must_not_be_inverted() -> None:
    with pytest.raises(ValidationError, match="on_track"):
        BatchDeadlineConfig(margin=0.5, on_track=0.8)


# the lever: the background window's floor ----------------------------------------------------------------------------

def test_a_floor_holds_the_window_up_to_its_ceiling_but_not_past_a_closed_lane() -> None:
    window = BackgroundWindow(size=1.0, ceiling=6, floor=4)
    assert window.limit() == 4
    window.congested(0.0)  # a foreground miss halves the window: the floor still holds it
    assert window.limit() == 4
    window.floor = 12
    assert window.limit() == 6  # never above the class's max_concurrency
    limits = {"chat": 8, "batch": 6}
    assert lane_limits(limits, {"batch": window}, {"batch"}, headroom=True)["batch"] == 6
    assert lane_limits(limits, {"batch": window}, {"batch"}, headroom=False)["batch"] == 0


def _lane(pressure: dict[str, bool]) -> AdmissionControl:
    classes = {"chat": TrafficClassConfig(priority=0, max_concurrency=1, queue_length=8),
               "batch": TrafficClassConfig(priority=9, max_concurrency=8, queue_length=16, background=True)}
    return AdmissionControl(TrafficConfig(classes=classes), FakeClock(), lambda pool: False,
                            lambda pool: pressure[pool])


async def test_a_raised_floor_lets_more_batch_work_in_only_while_the_foreground_leaves_headroom() -> None:
    pressure = {"p": False}
    ctl = _lane(pressure)
    _, first = await ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k")
    waiting = [asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "batch", 9, "k")) for _ in range(3)]
    await _settle()
    assert not any(w.done() for w in waiting)  # the window starts at one
    ctl.set_lane_floor("batch", 3)  # a job at risk: step 1 of 3 per step
    ctl._pump("p")
    await _settle()
    assert sum(w.done() for w in waiting) == 2 and ctl.gates["p"].in_flight["batch"] == 3
    assert ctl.gates["p"].windows["batch"].floor == 3 and ctl.lane_floor("batch") == 3
    # a foreground request waits: the lane closes whatever the floor
    _, chat = await ctl.admit(FakeClient().receive, ["p"], "chat", 0, "k")
    queued_chat = asyncio.ensure_future(ctl.admit(FakeClient().receive, ["p"], "chat", 0, "k"))
    await _settle()
    ctl.set_lane_floor("batch", 8)
    for w in waiting:
        if w.done():
            w.result()[1].release()
    first.release()
    await _settle()
    assert not waiting[2].done()  # chat is queued: no headroom, no batch admitted
    chat.release()
    _, chat2 = await asyncio.wait_for(queued_chat, 1)
    _, last = await asyncio.wait_for(waiting[2], 1)  # the foreground served, the lane opens
    pressure["p"] = True  # a saturated replica: no headroom either
    assert ctl._limit(ctl.gates["p"], "p", "batch") == 0
    chat2.release(), last.release()
    ctl.set_lane_floor("batch", 0)
    assert ctl.gates["p"].windows["batch"].floor == 0


# the runner: every gateway forecasts every job, the one running it steps its share --------------------------------

def _runner(admission: AdmissionControl) -> BatchRunner:
    config = GatewayConfig.model_validate({"model": "m", "pools": [{"name": "p", "max_model_len": 8192}],
                                           "batch": {"deadline": {"step_interval_s": 10.0, "window_per_step": 4}}})
    gateway = SimpleNamespace(config=config, traffic=SimpleNamespace(admission=admission))
    return BatchRunner(gateway, SimpleNamespace())  # type: ignore[arg-type]


def _in_progress(runner: BatchRunner, now: float, done: int, samples: list[tuple[float, int]]) -> None:
    batch = {"id": "batch_a", "status": "in_progress", "expires_at": now + 100,
             "request_counts": {"total": 100, "completed": done, "failed": 0}}
    runner._active = [("", batch)]
    runner._progress["batch_a"] = deque(samples)


def test_the_runner_steps_the_share_of_the_jobs_it_holds_and_sets_the_lane_floor() -> None:
    ctl = _lane({"p": False})
    runner, now = _runner(ctl), 1000.0
    _in_progress(runner, now, 10, [(now - 20, 0), (now, 10)])  # 0.5 lines/s, 90 left: 180 s of 100
    runner._judge_deadlines(now, held={"batch_a"})
    outlook = runner.outlook("batch_a")
    assert outlook == {"predicted_finish_at": 1180, "lines_per_s": 0.5, "at_risk": True, "share_step": 1}
    assert runner.metrics.share_raises == 1 and ctl.lane_floor("batch") == 4
    runner._judge_deadlines(now + 1, held={"batch_a"})  # within the interval: held
    assert runner.outlook("batch_a")["share_step"] == 1 and runner.metrics.share_raises == 1
    # since the raise, 60 lines in 15 s: 30 left need 7.5 s of 85: back on track, a step down, the floor with it
    _in_progress(runner, now, 70, [(now - 20, 0), (now, 10), (now + 15, 70)])
    runner._judge_deadlines(now + 15, held={"batch_a"})
    assert runner.outlook("batch_a") == {"predicted_finish_at": 1023, "lines_per_s": 4.0, "at_risk": False,
                                         "share_step": 0}
    assert runner.metrics.share_lowers == 1 and ctl.lane_floor("batch") == 0
    assert runner.outlook("batch_b")["share_step"] == 0  # not in progress: nothing predicted


def test_a_gateway_not_running_the_job_forecasts_it_alike_but_takes_no_step() -> None:
    ctl = _lane({"p": False})
    runner, now = _runner(ctl), 1000.0
    _in_progress(runner, now, 10, [(now - 20, 0), (now, 10)])
    runner._judge_deadlines(now, held=set())
    assert runner.outlook("batch_a")["at_risk"] and runner.outlook("batch_a")["share_step"] == 1
    assert runner.metrics.share_raises == 0 and ctl.lane_floor("batch") == 0
    metrics = {m.name: m for m in runner.metrics.collect()}
    assert metrics["m3gate_batch_jobs_at_risk"].samples[0].value == 1
    assert metrics["m3gate_batch_deadline_slack_seconds"].samples[0].value == -80.0  # predicted 80 s late


def test_past_its_window_a_job_is_at_risk_but_takes_no_more_steps() -> None:
    ctl = _lane({"p": False})
    runner, now = _runner(ctl), 1000.0
    _in_progress(runner, now, 10, [(now - 20, 0), (now, 10)])
    runner._judge_deadlines(now + 150, held={"batch_a"})  # its deadline was at 1100
    assert runner.outlook("batch_a")["at_risk"] and runner.outlook("batch_a")["share_step"] == 0
    assert runner.metrics.share_raises == 0
