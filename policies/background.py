"""The background lane: classes with `background: true` use only the capacity the foreground classes leave.

Per pool, a background class is admitted only into headroom (`has_headroom`: no foreground class waits in the
pool's queue, no replica is saturated, the foreground classes' recent TTFT there within target), and at most
`BackgroundWindow.limit()` of its requests are in flight. The window is AIMD, as TCP's congestion window: one more
per request that ended well while the window was in use (additive increase), halved on a sign of congestion (a
refusal, a saturated replica, a foreground request that missed its TTFT target: multiplicative decrease), at most
once per `DECREASE_HOLD_S` so one burst of signals counts once. Background requests are long, so the additive
increase alone took many of them to regrow a window a foreground burst had cut; after a cut, each `RECOVER_S`
without a new signal also wins back half of what is missing of the size before it (as BIC-TCP's binary search):
a burst costs the lane a few seconds, not its next few minutes. A floor (`BackgroundWindow.floor`, set for batch
jobs at risk of missing their deadline, policies/batch_deadline.py) keeps the window from being cut below it, but
never lets the class in without headroom: a foreground class that queues, a saturated replica or a missed
foreground target still stop the lane entirely. Pure: time is passed in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

DECREASE_FACTOR = 0.5
DECREASE_HOLD_S = 1.0  # signals closer together than this are one congestion event
RECOVER_S = 1.0  # after a cut, each this long without a signal regains half the gap to the size before it
LATENCY_WINDOW_S = 30.0  # foreground TTFTs this recent say whether there is headroom
LATENCY_SAMPLES = 256
LATENCY_QUANTILE = 0.95


@dataclass(slots=True)
class BackgroundWindow:
    """One background class's in-flight window in one pool (AIMD)."""

    size: float = 1.0
    ceiling: int = 64  # the class's max_concurrency
    decreased_at: float = -math.inf
    increases: int = 0
    decreases: int = 0
    floor: int = 0  # urgent work's minimum (batch deadlines); the headroom gate still stops the lane entirely
    before_cut: float = 0.0  # its size before the latest cut, until regained
    recovered_at: float = -math.inf

    def limit(self) -> int:
        """Requests of the class that may be in flight in the pool now: at least one and at least the floor, at
        most the ceiling (the headroom gate, not the window, is what stops it entirely)."""
        return max(1, min(self.ceiling, max(self.floor, int(self.size))))

    def succeeded(self, in_flight_before: int) -> None:
        """One of its requests ended well. The window grows only while it was in use (`in_flight_before`: its
        requests in flight before this one ended), so a window an idle lane never tested does not grow."""
        if in_flight_before >= self.limit() and self.size < self.ceiling:
            self.size = min(float(self.ceiling), self.size + 1.0)
            self.increases += 1

    def congested(self, now: float) -> bool:
        """A refusal, a saturated replica or a missed foreground target: halve the window, once per
        DECREASE_HOLD_S. True when it was cut."""
        if now - self.decreased_at < DECREASE_HOLD_S:
            return False
        self.decreased_at = self.recovered_at = now
        self.before_cut = max(self.before_cut, self.size)  # a cut before the last one was regained keeps its aim
        self.size = max(1.0, self.size * DECREASE_FACTOR)
        self.decreases += 1
        return True

    def recover(self, now: float) -> None:
        """Called while the lane runs: each RECOVER_S since the latest cut (or recovery step) with no new signal,
        half the gap to the size before the cut comes back."""
        if self.before_cut <= self.size or now - self.recovered_at < RECOVER_S:
            return
        self.recovered_at = now
        self.size = min(float(self.ceiling), math.ceil(self.size + (self.before_cut - self.size) / 2))
        if self.size >= self.before_cut - 0.5:
            self.size, self.before_cut = max(self.size, self.before_cut), 0.0

    def resize(self, ceiling: int) -> None:
        """A reload changed the class's max_concurrency."""
        self.ceiling = ceiling
        self.size = min(self.size, float(ceiling))


class ForegroundLatency:
    """The foreground requests' recent time to first token in one pool, each as a share of its class's target
    (1.0: exactly on target), over LATENCY_WINDOW_S and at most LATENCY_SAMPLES."""

    __slots__ = ("_samples",)

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=LATENCY_SAMPLES)

    def observe(self, now: float, ttft_s: float, target_s: float) -> bool:
        """Records one; True when it missed its target."""
        ratio = ttft_s / target_s
        self._samples.append((now, ratio))
        return ratio > 1.0

    def within_target(self, now: float) -> bool:
        """The recent p95 of TTFT ÷ target is at most 1 (true with no recent sample: nothing says otherwise)."""
        samples = self._samples
        while samples and samples[0][0] < now - LATENCY_WINDOW_S:
            samples.popleft()
        if not samples:
            return True
        ratios = sorted(r for _, r in samples)
        return ratios[min(len(ratios) - 1, math.ceil(LATENCY_QUANTILE * len(ratios)) - 1)] <= 1.0


def has_headroom(queued_classes: Iterable[str], background: Collection[str], pressure: bool,
                 latency_ok: bool) -> bool:
    """A background request may go to the pool now: no foreground class waits there, no replica of it is
    saturated (`pressure`), and the foreground's recent TTFT is within target."""
    if pressure or not latency_ok:
        return False
    return all(cls in background for cls in queued_classes)


def lane_limits(limits: Mapping[str, int], windows: Mapping[str, BackgroundWindow], background: Collection[str],
                headroom: bool) -> dict[str, int]:
    """The class limits in one pool with the background lane applied: a background class may have its window
    in flight while there is headroom, none more while there is not."""
    out = dict(limits)
    for cls in background:
        if cls in out:
            window = windows.get(cls)
            out[cls] = 0 if not headroom else min(out[cls], window.limit() if window is not None else 1)
    return out
