"""Reads what a live Prometheus measured of the gateway, for `m3gate contract --prometheus URL --window 1h`.

Per class, over the window: each target metric's P50/P95/P99 (`histogram_quantile` over the gateway's own
histograms, summed across pools, replicas and thinking modes), its sample count, and each stage's P95 (gateway
queue, engine queue + prefill, decode), so a failed target can name the stage that dominates it.
"""

from __future__ import annotations

import math
from typing import Any

import httpx

from policies.contract import METRIC_SERIES, STAGE_SERIES, Observed


class PrometheusError(RuntimeError):
    pass


def instant_query(base_url: str, expr: str, timeout_s: float = 10.0,
                  client: httpx.Client | None = None) -> list[tuple[dict[str, str], float]]:
    """GET /api/v1/query: the instant vector's (labels, value) pairs; NaN values are left out."""
    own = client is None
    client = client or httpx.Client(timeout=timeout_s)
    try:
        resp = client.get(base_url.rstrip("/") + "/api/v1/query", params={"query": expr})
    except httpx.HTTPError as exc:
        raise PrometheusError(f"{base_url}: {exc}") from exc
    finally:
        if own:
            client.close()
    try:
        body = resp.json()
    except ValueError as exc:
        raise PrometheusError(f"{base_url}: HTTP {resp.status_code}, not JSON") from exc
    if body.get("status") != "success":
        raise PrometheusError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
    out = []
    for sample in body["data"]["result"]:
        value = float(sample["value"][1])
        if not math.isnan(value):
            out.append((sample["metric"], value))
    return out


def observe_classes(base_url: str, window: str, classes: list[str] | None = None) -> dict[str, Observed]:
    """class → Observed over `window` (a PromQL duration: 5m, 1h, 1d)."""
    observed: dict[str, Observed] = {}

    def of(cls: str) -> Observed:
        return observed.setdefault(cls, Observed())

    with httpx.Client(timeout=15.0) as client:
        for metric, series in METRIC_SERIES.items():
            for pct in ("p50", "p95", "p99"):
                q = int(pct[1:]) / 100
                expr = f"histogram_quantile({q}, sum by (class, le) (rate({series}_bucket[{window}])))"
                for labels, value in instant_query(base_url, expr, client=client):
                    of(labels.get("class", "")).quantiles.setdefault(metric, {})[pct] = value
            for labels, value in instant_query(base_url, f"sum by (class) (increase({series}_count[{window}]))",
                                               client=client):
                of(labels.get("class", "")).samples[metric] = int(round(value))
        for stage, series in STAGE_SERIES.items():
            expr = f"histogram_quantile(0.95, sum by (class, le) (rate({series}_bucket[{window}])))"
            for labels, value in instant_query(base_url, expr, client=client):
                of(labels.get("class", "")).stages_p95_s[stage] = value
    if classes is not None:
        observed = {k: v for k, v in observed.items() if k in classes}
    return observed


def describe(observed: dict[str, Observed]) -> dict[str, Any]:
    return {cls: {"quantiles_s": o.quantiles, "samples": o.samples, "stages_p95_s": o.stages_p95_s}
            for cls, o in observed.items()}
