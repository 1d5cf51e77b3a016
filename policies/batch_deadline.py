"""Batch deadlines (docs/batch.md, Deadlines), pure: whether a job will finish inside its completion window at the
rate it runs now, and the share step that follows.

A job's forecast comes from its lines left and its lines per second measured over a recent window: the time those
lines need at that rate, as a share of the time left to its deadline. Above `margin` the job is at risk and its
share step rises by one; below `on_track` it falls by one; in between it holds. A step changes at most once per
`step_interval_s` (the rate has to show the last change before the next). Steps act only through the background
lane (policies/background.py): they raise the batch window's floor, which the lane still cuts to nothing whenever
a foreground class queues, a replica saturates or the foreground misses its TTFT target, so a raised share never
takes capacity a foreground class needs for its targets. No I/O, time is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from policies.config import BatchDeadlineConfig


@dataclass(frozen=True, slots=True)
class Forecast:
    """A job's outlook at its current share."""

    lines_per_s: float
    predicted_finish_at: float | None  # None: no rate measured yet, or none at all (it would never finish)
    needed_share: float | None  # time its lines left need ÷ time left (inf: no progress); None: not measured yet
    at_risk: bool


@dataclass(frozen=True, slots=True)
class ShareStep:
    """A job's share step (0: the lane's own window) and when it last changed."""

    step: int = 0
    changed_at: float = -math.inf


def measured_rate(samples: Sequence[tuple[float, int]], min_span_s: float, since: float = -math.inf) -> \
        float | None:
    """Lines per second over (time, lines done) samples, oldest first: over those from `since` on (its share's
    last change: the rate at its current share) once they span `min_span_s`, else over them all; None until they
    span `min_span_s` (a job that just started has not had the time to show its rate)."""
    recent = [s for s in samples if s[0] >= since]
    for chosen in (recent, samples):
        if len(chosen) >= 2 and chosen[-1][0] - chosen[0][0] >= min_span_s:
            (t0, done0), (t1, done1) = chosen[0], chosen[-1]
            return max(0.0, (done1 - done0) / (t1 - t0))
    return None


def forecast(lines_left: int, rate: float | None, now: float, deadline: float, margin: float) -> Forecast:
    """The job's predicted finish at `rate` and whether it is at risk: its lines left need more than `margin` of
    the time left (a measured rate of zero with lines left: at risk, no finish predicted)."""
    if lines_left <= 0:
        return Forecast(rate or 0.0, now, 0.0, False)
    if rate is None:
        return Forecast(0.0, None, None, False)
    time_left = max(deadline - now, 1e-9)
    if rate <= 0:
        return Forecast(0.0, None, math.inf, True)
    needed = lines_left / rate
    share = needed / time_left
    return Forecast(rate, now + needed, share, share > margin)


def next_step(current: ShareStep, outlook: Forecast, now: float, rule: BatchDeadlineConfig) -> ShareStep:
    """One step up while at risk (at most `max_step`), one down once back on track, none within
    `step_interval_s` of the last change; a job not yet measured keeps its step."""
    if outlook.needed_share is None or now - current.changed_at < rule.step_interval_s:
        return current
    if outlook.at_risk and current.step < rule.max_step:
        return ShareStep(current.step + 1, now)
    if current.step > 0 and outlook.needed_share < rule.on_track:
        return ShareStep(current.step - 1, now)
    return current


def lane_floor(steps: Iterable[int], window_per_step: int) -> int:
    """The batch class's background window floor: the highest step of the jobs run here, times the step size (the
    most urgent job is served first anyway: jobs go earliest deadline first)."""
    return max(steps, default=0) * window_per_step
