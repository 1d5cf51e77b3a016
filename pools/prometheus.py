"""Reads what a live Prometheus measured of the gateway, for `m3gate contract --prometheus URL --window 1h` and
`m3gate plan --prometheus URL --window 1h` (`observe_demand`).

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


def observe_demand(base_url: str, window: str) -> dict[str, dict[str, dict[str, float]]]:
    """pool → class → {prompt, cached, output (mean tokens per answered request), rate_mean, rate_peak (requests
    per second: over `window`, and the busiest minute in it)} from the gateways' counters, summed over gateways."""
    by = "sum by (pool, class)"
    queries = {
        "rate_mean": f"{by} (rate(m3gate_requests_total[{window}]))",
        "rate_peak": f"max_over_time(({by} (rate(m3gate_requests_total[1m])))[{window}:1m])",
        "answered": f'{by} (increase(m3gate_requests_total{{status="200"}}[{window}]))',
        "prompt": f"{by} (increase(m3gate_prompt_tokens_total[{window}]))",
        "cached": f"{by} (increase(m3gate_cached_prompt_tokens_total[{window}]))",
        "output": f"{by} (increase(m3gate_output_tokens_total[{window}]))",
    }
    values: dict[tuple[str, str], dict[str, float]] = {}
    with httpx.Client(timeout=15.0) as client:
        for name, expr in queries.items():
            for labels, value in instant_query(base_url, expr, client=client):
                pool, cls = labels.get("pool", ""), labels.get("class", "")
                if pool and pool != "none":
                    values.setdefault((pool, cls or pool), {})[name] = value
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (pool, cls), v in values.items():
        answered = v.get("answered", 0.0)
        if answered <= 0.0 or v.get("rate_mean", 0.0) <= 0.0:
            continue
        mean = v["rate_mean"]
        out.setdefault(pool, {})[cls] = {
            "prompt": v.get("prompt", 0.0) / answered, "cached": v.get("cached", 0.0) / answered,
            "output": v.get("output", 0.0) / answered, "rate_mean": mean, "rate_peak": max(mean, v.get("rate_peak", 0.0))}
    return out


def describe(observed: dict[str, Observed]) -> dict[str, Any]:
    return {cls: {"quantiles_s": o.quantiles, "samples": o.samples, "stages_p95_s": o.stages_p95_s}
            for cls, o in observed.items()}
