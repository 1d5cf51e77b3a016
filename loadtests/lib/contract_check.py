"""`python -m loadtests run WORKLOAD --contract [CONFIG]`: the operating contract (policies/contract.py) checked
against a load-test run.

Each request's TTFT, TPOT ((end − first token) / (output tokens − 1), streams) and end-to-end latency as the client
measured them, grouped by the traffic class of the pool that answered (`x-m3gate-endpoint` → pool → class); each
class's stage P95s (gateway queue, engine queue + prefill, decode) from the gateway's own histograms, the difference
of two /metrics scrapes around the run. The contract, its verdicts and plots go to <results>/contract/.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.contract import write_contract
from policies.config import GatewayConfig
from policies.contract import STAGE_SERIES, Contract, build_contract, check, histogram_quantile, observed_from_samples
from policies.traffic import pool_class

Histograms = dict[tuple[str, str], dict[float, float]]  # (series, class) → le → cumulative count


def scrape_stages(gateway_url: str | None) -> Histograms:
    """The gateway's stage histograms per class, summed over pools (empty without a gateway or metrics)."""
    if not gateway_url:
        return {}
    try:
        text = httpx.get(gateway_url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    wanted = set(STAGE_SERIES.values())
    out: Histograms = {}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                continue
            key = (family.name, sample.labels.get("class", ""))
            le = float(sample.labels["le"])
            bucket = out.setdefault(key, {})
            bucket[le] = bucket.get(le, 0.0) + sample.value
    return out


def stage_p95(before: Histograms, after: Histograms) -> dict[str, dict[str, float | None]]:
    """class → stage → P95 over what happened between the two scrapes."""
    out: dict[str, dict[str, float | None]] = {}
    names = {series: stage for stage, series in STAGE_SERIES.items()}
    for (series, cls), cumulative in after.items():
        old = before.get((series, cls), {})
        les = sorted(cumulative)
        deltas = [cumulative[le] - old.get(le, 0.0) for le in les]
        counts = [deltas[0]] + [b - a for a, b in zip(deltas, deltas[1:])]
        bounds = [le for le in les if le != float("inf")]
        out.setdefault(cls, {})[names[series]] = histogram_quantile(0.95, bounds, counts)
    return out


def class_samples(config: GatewayConfig, results: list[Any]) -> dict[str, dict[str, list[float]]]:
    """class → ttft / tpot / e2e → seconds, from the client's results (successful requests only)."""
    pools = config.pools_by_size()
    by_endpoint = {url: p.name for p in pools for url in p.endpoints}
    samples: dict[str, dict[str, list[float]]] = {}
    for r in results:
        if not r.ok or r.status != 200:
            continue
        pool = by_endpoint.get((r.replica or "").rstrip("/"))
        if pool is None:
            continue
        into = samples.setdefault(pool_class(config.traffic, pools, pool), {"ttft": [], "tpot": [], "e2e": []})
        if r.e2el is not None:
            into["e2e"].append(r.e2el)
        if r.stream and r.ttft is not None:
            into["ttft"].append(r.ttft)
            if r.e2el is not None and r.output_tokens and r.output_tokens > 1:
                into["tpot"].append((r.e2el - r.ttft) / (r.output_tokens - 1))
    return samples


def check_run(config: GatewayConfig | Mapping[str, Any], results: list[Any], stages_before: Histograms,
              stages_after: Histograms, source: str, out_dir: Path | None) -> Contract:
    cfg = config if isinstance(config, GatewayConfig) else GatewayConfig.model_validate(dict(config))
    observed = observed_from_samples(class_samples(cfg, results), stage_p95(stages_before, stages_after))
    contract = check(build_contract(cfg), observed, source)
    if out_dir is not None:
        paths = write_contract(contract, out_dir / "contract")
        print("contract: " + ", ".join(str(p) for p in paths.values()))
    return contract
