"""The Batch API's Prometheus series: m3gate_batch_requests_total{status} (lines finished here: completed, failed,
expired) and m3gate_batch_jobs{status} (jobs in the store by status, as the runner last read them)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from policies.batch import ACTIVE_STATUSES, FINAL_STATUSES


class BatchMetrics:
    """A collector read at scrape time; written only on the event loop (no lock, as gateway/observability's)."""

    def __init__(self) -> None:
        self.requests: dict[str, float] = {"completed": 0.0, "failed": 0.0, "expired": 0.0}
        self.jobs: dict[str, int] = {}

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
