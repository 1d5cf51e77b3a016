"""The Batch API's metrics: m3gate_batch_requests_total{status} (lines finished by this gateway: completed, failed,
expired), m3gate_batch_jobs{status} (jobs in the store by status, as the runner last read them), and the deadline
figures of the jobs in progress (docs/batch.md, Deadlines): m3gate_batch_lines_per_second{batch},
m3gate_batch_deadline_slack_seconds{batch} (deadline − predicted finish; negative: predicted late),
m3gate_batch_share_step{batch}, m3gate_batch_jobs_at_risk, and m3gate_batch_share_raises_total /
m3gate_batch_share_lowers_total (the steps this gateway took for the jobs it runs)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from policies.batch import ACTIVE_STATUSES, FINAL_STATUSES
from policies.batch_deadline import Forecast


class JobOutlook(NamedTuple):
    """An in-progress job's forecast against its deadline and its share step, as of the runner's last look."""

    forecast: Forecast
    expires_at: float
    share_step: int

    def slack_s(self) -> float | None:
        """Seconds between the predicted finish and the deadline (negative: late); None: no prediction."""
        finish = self.forecast.predicted_finish_at
        return None if finish is None else self.expires_at - finish

    def to_json(self) -> dict[str, object]:
        """The batch object's `m3gate` field."""
        finish = self.forecast.predicted_finish_at
        return {"predicted_finish_at": None if finish is None else math.ceil(finish),
                "lines_per_s": round(self.forecast.lines_per_s, 3), "at_risk": self.forecast.at_risk,
                "share_step": self.share_step}


NO_OUTLOOK = {"predicted_finish_at": None, "lines_per_s": 0.0, "at_risk": False, "share_step": 0}


class BatchMetrics:
    """A collector read at scrape time; written only on the event loop (no lock, as gateway/observability's)."""

    def __init__(self) -> None:
        self.requests: dict[str, float] = {"completed": 0.0, "failed": 0.0, "expired": 0.0}
        self.jobs: dict[str, int] = {}
        self.outlooks: dict[str, JobOutlook] = {}  # batch id → its outlook (jobs in progress)
        self.share_raises = 0.0
        self.share_lowers = 0.0

    def requests_done(self, status: str, n: int = 1) -> None:
        self.requests[status] = self.requests.get(status, 0.0) + n

    def describe(self) -> Iterator[Metric]:
        yield from self.collect()

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("m3gate_batch_requests_total", "Batch API lines finished by this gateway.",
                                       labels=["status"])
        for status, value in self.requests.items():
            requests.add_metric([status], value)
        jobs = GaugeMetricFamily("m3gate_batch_jobs", "Batch jobs in the store, by status.", labels=["status"])
        for status in (*ACTIVE_STATUSES, *FINAL_STATUSES):
            jobs.add_metric([status], float(self.jobs.get(status, 0)))
        yield requests
        yield jobs
        yield from self._deadlines()

    def _deadlines(self) -> Iterator[Metric]:
        rate = GaugeMetricFamily("m3gate_batch_lines_per_second", "Lines per second of each batch job in progress, "
                                 "over its recent window.", labels=["batch"])
        slack = GaugeMetricFamily("m3gate_batch_deadline_slack_seconds", "Deadline minus predicted finish of each "
                                  "batch job in progress (negative: predicted late).", labels=["batch"])
        step = GaugeMetricFamily("m3gate_batch_share_step", "Share step of each batch job in progress (0: the "
                                 "background lane's own window).", labels=["batch"])
        for batch_id, outlook in sorted(self.outlooks.items()):
            rate.add_metric([batch_id], outlook.forecast.lines_per_s)
            step.add_metric([batch_id], float(outlook.share_step))
            if (seconds := outlook.slack_s()) is not None:
                slack.add_metric([batch_id], seconds)
        yield rate
        yield slack
        yield step
        yield GaugeMetricFamily("m3gate_batch_jobs_at_risk", "Batch jobs in progress predicted to miss their "
                                "completion window at their current share.",
                                value=float(sum(o.forecast.at_risk for o in self.outlooks.values())))
        yield CounterMetricFamily("m3gate_batch_share_raises_total", "Share steps raised by this gateway for batch "
                                  "jobs at risk of missing their deadline.", value=self.share_raises)
        yield CounterMetricFamily("m3gate_batch_share_lowers_total", "Share steps lowered by this gateway for batch "
                                  "jobs back on track.", value=self.share_lowers)
