"""When the gateway next looks at each replica: its /metrics scrape and its /health probe (pools/monitor.py acts).

Routing needs fresh load only from replicas that carry some: a replica with requests in flight, dispatched to since
its last visit, or whose scrape shows running or waiting requests (another gateway's) is visited every base
interval. An idle one backs off (×`BACKOFF_FACTOR` per quiet visit, up to `MAX_BACKOFF` × the interval) and snaps
back to the base interval as soon as a request is dispatched to it. Backed-off visits fall on a grid shifted by the
replica's own `phase` (whole intervals), so a large idle fleet is probed a slice at a time over the period, not in
one burst (a gap is at most the longest period plus one interval: 34 s at the default 2 s).

/health is what shows a dead engine or a replica told to drain (vLLM answers it 503 while /metrics and even requests
may still answer), so every visit probes it before the scrape: a replica with load shows a 503 within an interval,
an idle one at its next backed-off visit. A replica that is unhealthy or shutting down, or whose request or scrape
just failed, is visited at the base interval (a failure: at once, at most once per interval), so its recovery or
death shows quickly.

Pure: no I/O; every time is passed in (monotonic seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKOFF_FACTOR = 2.0
MAX_BACKOFF = 16.0  # × the base interval: 32 s at the default 2 s


@dataclass(slots=True)
class ProbeState:
    """One replica's probing schedule."""

    phase: float  # in [0, 1): where on each backed-off period its visits fall (from its URL: spreads a fleet)
    period_s: float  # the current gap between visits
    next_at: float  # its next visit
    visited_at: float = -math.inf  # its last visit
    health_wanted: bool = True  # its /health failed or timed out, or a request or scrape failed: at the interval
    dispatches: int = 0  # the replica's dispatch count at the last visit: a change means it was dispatched to


@dataclass(frozen=True, slots=True)
class Visit:
    """What the monitor saw at a visit; `dispatches` is the replica's running count."""

    healthy: bool
    shutting_down: bool
    in_flight: int
    dispatches: int
    engine_load: float  # scraped running + waiting requests (0 when unknown)
    scraped: bool  # /metrics answered 200


class ProbingPolicy:
    """Decides each replica's next visit."""

    def __init__(self, interval_s: float, backoff_factor: float = BACKOFF_FACTOR,
                 max_backoff: float = MAX_BACKOFF) -> None:
        self.interval_s = interval_s
        self.backoff_factor = backoff_factor
        self.max_period_s = interval_s * max(1.0, max_backoff)

    def new(self, now: float, phase: float) -> ProbeState:
        """A replica the monitor has just learnt of: visited at once, /health included."""
        return ProbeState(phase=phase % 1.0, period_s=self.interval_s, next_at=now)

    def health_answered(self, state: ProbeState, ok: bool) -> None:
        """/health answered (`ok`: 200); a timed-out probe is `health_failed`."""
        state.health_wanted = not ok

    def health_failed(self, state: ProbeState) -> None:
        """A probe timed out or a scrape failed: /health at the next visit, at the base interval."""
        state.health_wanted = True

    def visited(self, state: ProbeState, now: float, seen: Visit) -> None:
        """Schedule the next visit from what this one saw."""
        dispatched = seen.dispatches != state.dispatches
        state.dispatches, state.visited_at = seen.dispatches, now
        if not seen.scraped and seen.healthy and not seen.shutting_down:
            state.health_wanted = True  # /metrics failed: /health decides, at the next visit
        busy = seen.in_flight > 0 or dispatched or seen.engine_load > 0
        if busy or state.health_wanted or not seen.healthy or seen.shutting_down:
            state.period_s = self.interval_s
            state.next_at = now + self.interval_s
            return
        state.period_s = min(self.max_period_s, state.period_s * self.backoff_factor)
        state.next_at = self._on_grid(state, now)

    def dispatched(self, state: ProbeState, now: float) -> bool:
        """A request was dispatched to a backed-off replica: back to the base interval, its next visit no later than
        one interval after its last. True when the visit moved earlier."""
        state.period_s = self.interval_s
        due = max(now, state.visited_at + self.interval_s)
        if due < state.next_at:
            state.next_at = due
            return True
        return False

    def failed(self, state: ProbeState, now: float) -> bool:
        """A real request failed on the replica (5xx, refused, broken, timed out) or it started draining: /health at
        once, but no sooner than one interval after its last visit (a burst of failures costs one probe). True when
        the visit moved earlier."""
        state.health_wanted = True
        state.period_s = self.interval_s
        due = max(now, state.visited_at + self.interval_s)
        if due < state.next_at:
            state.next_at = due
            return True
        return False

    def backed_off(self, state: ProbeState) -> bool:
        """Visited less often than every interval (a dispatch then moves its next visit earlier)."""
        return state.period_s > self.interval_s

    def _on_grid(self, state: ProbeState, now: float) -> float:
        """The first point of the replica's grid (its period, shifted by its phase) at least one interval away: once
        at the longest period its visits are exactly that far apart, at its phase in it. Phases are whole intervals,
        so the visits due together run together (one wake-up, warm caches: a lone visit costs about twice as much)."""
        period, interval = state.period_s, self.interval_s
        offset = math.floor(state.phase * period / interval) * interval
        earliest = now + self.interval_s
        return offset + math.ceil((earliest - offset) / period) * period
