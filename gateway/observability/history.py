"""`History`: the points behind the status page's charts, the last 15 minutes of a gateway in bounded memory.

A background task, started and stopped with the app, takes one sample every EVERY_S seconds into a ring of POINTS:
per traffic class the TTFT and TPOT p95 and the requests admitted per second over the trailing minute (from the
gateway's own latency histograms: bucket deltas between the newest cumulative snapshot and the one a minute older, as
Prometheus' `histogram_quantile(0.95, rate(...[1m]))` would draw it), and per pool the requests in flight and the mean
KV-cache use of its replicas at the sample's moment. The page asks only for the points it has not seen yet.

The cumulative snapshots of the last TABLE_WINDOW_S are kept too: they are the baseline of the page's class table
(percentiles and rates over the last five minutes, or since the gateway started).

Memory: POINTS points of a few numbers per class and pool, plus TABLE_WINDOW_S / EVERY_S cumulative snapshots
(a few hundred floats each). A sample costs one pass over the histogram series (tens of µs), every EVERY_S seconds.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gateway.observability.telemetry import Telemetry
from policies.config import GatewayConfig
from policies.contract import histogram_quantile
from pools.replicas import PoolRuntime
from pools.tasks import Periodic

log = logging.getLogger("m3gate.history")

EVERY_S = 5.0
POINTS = 180  # 15 minutes at EVERY_S
TRAILING_S = 60.0  # each point's percentiles and rate cover the minute before it
TABLE_WINDOW_S = 300.0  # the page's class table: latency and rates over the last five minutes

ClassCounts = dict[str, dict[str, list[float]]]  # class → kind (ttft, tpot, e2e, requests, r429) → counts


class Gateway(Protocol):
    """What the history reads of the gateway it samples (gateway/runtime.py's `Gateway`), named here so that
    observability imports nothing above it: its clock, its metrics, its pools' replicas, and whether the page is on."""

    clock: Callable[[], float]
    telemetry: Telemetry
    pools: Mapping[str, PoolRuntime]
    config: GatewayConfig


def class_counts(gw: Gateway) -> ClassCounts | None:
    """Per class, the gateway's histograms summed over pools, APIs and thinking modes (bucket counts + sum), and
    the request counters; None when the gateway keeps no metrics."""
    metrics = gw.telemetry.metrics
    if metrics is None:
        return None
    req = metrics.requests
    out: ClassCounts = {}

    def add(kind: str, cls: str, series: list[float]) -> None:
        into = out.setdefault(cls, {}).get(kind)
        if into is None:
            out[cls][kind] = list(series)
        else:
            for i, v in enumerate(series):
                into[i] += v

    for key, series in list(req.ttft.series.items()):  # (api, pool, class, thinking_mode)
        add("ttft", key[2], series)
    for key, series in list(req.e2e.series.items()):
        add("e2e", key[2], series)
    for key, series in list(req.tpot.series.items()):  # (pool, class, thinking_mode)
        add("tpot", key[1], series)
    for key, value in list(req.requests.values.items()):  # (api, pool, class, thinking_mode, status)
        add("requests", key[2], [value])
        if key[4] == "429":
            add("r429", key[2], [value])
    return out


def delta(new: list[float] | None, old: list[float] | None) -> list[float]:
    """Counts observed between two cumulative snapshots of one series (a series that vanished counts from zero)."""
    if new is None:
        return []
    if old is None or len(old) != len(new):
        return list(new)
    return [max(0.0, a - b) for a, b in zip(new, old)]


def p95_ms(bounds: tuple[float, ...], counts: list[float]) -> float | None:
    if not counts:
        return None
    value = histogram_quantile(0.95, bounds, counts)
    return None if value is None else round(value * 1000, 2)


class History:
    """The ring of chart points and the task that fills it. One per app (app.state.history)."""

    def __init__(self, gw: Gateway, *, every_s: float = EVERY_S, size: int = POINTS, trailing_s: float = TRAILING_S,
                 table_window_s: float = TABLE_WINDOW_S, wall: Callable[[], float] = time.time) -> None:
        self.gw = gw
        self.every_s = every_s
        self.points: deque[dict[str, Any]] = deque(maxlen=size)
        self._trailing = max(1, round(trailing_s / every_s))  # snapshots back to a point's baseline
        # (monotonic t, counts), oldest first: the baselines of the points and of the page's table
        self._snapshots: deque[tuple[float, ClassCounts]] = deque(
            maxlen=max(self._trailing, round(table_window_s / every_s)) + 1)
        self._wall = wall
        self._ticker = Periodic("m3gate-ui-history", self._tick, every_s, first_at_start=True, logger=log)

    def sample(self) -> dict[str, Any]:
        """Take one point now (the task calls this every `every_s`; tests call it directly)."""
        gw = self.gw
        now = gw.clock()
        point: dict[str, Any] = {"t": round(self._wall(), 3), "classes": self._classes(now), "pools": self._pools(now)}
        self.points.append(point)
        return point

    def _classes(self, now: float) -> dict[str, dict[str, float | None]]:
        counts = class_counts(self.gw)
        if counts is None:
            return {}
        self._snapshots.append((now, counts))
        base_t, base = self._snapshots[max(0, len(self._snapshots) - 1 - self._trailing)]
        if base is counts:  # the first sample: everything since the gateway started
            base = {}
        span = now - base_t
        req = self.gw.telemetry.metrics.requests  # type: ignore[union-attr]
        out: dict[str, dict[str, float | None]] = {}
        for cls, kinds in counts.items():
            before = base.get(cls, {})
            e2e = delta(kinds.get("e2e"), before.get("e2e"))
            admitted = sum(e2e[:-1]) if e2e else 0.0  # sent to a replica and answered: admitted
            out[cls] = {
                "ttft_p95_ms": p95_ms(req.ttft.bounds, delta(kinds.get("ttft"), before.get("ttft"))),
                "tpot_p95_ms": p95_ms(req.tpot.bounds, delta(kinds.get("tpot"), before.get("tpot"))),
                "admitted_per_s": round(admitted / span, 3) if span > 0 else None,
            }
        return out

    def _pools(self, now: float) -> dict[str, dict[str, float | None]]:
        out: dict[str, dict[str, float | None]] = {}
        for name, pool in self.gw.pools.items():
            kv = [s.kv_usage for s in pool.snapshots(now, role=None) if s.kv_usage is not None]
            out[name] = {"in_flight": sum(r.in_flight for r in pool.replicas.values()),
                         "kv_use": round(sum(kv) / len(kv), 4) if kv else None}
        return out

    def baseline(self, now: float) -> tuple[float, ClassCounts] | None:
        """The oldest kept snapshot (at most TABLE_WINDOW_S old) taken before `now`; None before the first."""
        if self._snapshots and self._snapshots[0][0] < now:
            return self._snapshots[0]
        return None

    def since(self, t: float | None) -> list[dict[str, Any]]:
        """The points newer than wall time `t` (all of them for None), oldest first."""
        if t is None:
            return list(self.points)
        return [p for p in self.points if p["t"] > t]

    def view(self, since: float | None) -> dict[str, Any]:
        return {"every_s": self.every_s, "size": self.points.maxlen, "points": self.since(since)}

    # ------------------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()

    def _tick(self) -> None:
        if self.gw.config.admin.ui:  # no page, no points (a reload may turn it on again)
            self.sample()
