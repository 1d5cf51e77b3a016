"""What a gateway's capacity signal says, read as an autoscaler and an operator read it."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def desired_replicas(url: str, pool: str = "chat", role: str = "both") -> float | None:
    """`m3gate_pool_desired_replicas{pool, role}` from the gateway's /metrics (None: no such series)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "m3gate_pool_desired_replicas" and s.labels == {"pool": pool, "role": role}:
                return s.value
    return None


def capacity_entry(url: str, pool: str = "chat", role: str = "both") -> dict[str, Any]:
    """The pool's entry of GET /admin/capacity."""
    return httpx.get(url + "/admin/capacity", timeout=10).json()["pools"][pool][role]
