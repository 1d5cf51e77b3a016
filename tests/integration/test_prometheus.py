"""A real Prometheus scrapes a real gateway and simulated pools under a short load, with deploy/prometheus/'s config
and alert rules; then every PromQL expression of the Grafana dashboard and of the alert rules is evaluated over the
run through Prometheus' HTTP API. Each must parse and return numbers: a panel that stays empty or an alert that
cannot fire under the very failure it is about is a bug. The stack (loadtests/observability_stack.py) is built so that
each failure happens: a slow replica, a failing one, a full KV cache, a dead replica, a dead Redis, a dead gateway.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from loadtests.observability_stack import (
    PROMETHEUS_CONFIG,
    RULES_DIR,
    PromQLError,
    Stack,
    alert_rules,
    concrete,
    dashboard_queries,
    finite_points,
    observability_stack,
    run_load,
    template_queries,
    wait_for_scrapes,
)

MISSING = [b for b in ("prometheus", "promtool") if shutil.which(b) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(bool(MISSING) and not os.environ.get("CI"),
                       reason=f"{' and '.join(MISSING)} not installed: run `make prometheus`"),
]
LOAD_SECONDS = 8.0


class Run:
    def __init__(self, stack: Stack, start: float, end: float, outcomes: Counter[str]) -> None:
        self.stack, self.start, self.end, self.outcomes = stack, start, end, outcomes

    def empty(self, exprs: list[tuple[str, str]]) -> list[str]:
        """The expressions that fail to parse or have no numeric sample over the run."""
        problems = []
        for name, expr in exprs:
            try:
                result = self.stack.prometheus.query_range(expr, self.start, self.end)
            except PromQLError as exc:
                problems.append(f"{name}: {exc}")
                continue
            if finite_points(result) == 0:
                problems.append(f"{name}: no data ({len(result)} series, all NaN or none): {expr}")
        return problems


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    with observability_stack(tmp_path_factory.mktemp("observability")) as stack:
        start = time.time()
        outcomes = run_load(stack.gateway.url, LOAD_SECONDS)
        wait_for_scrapes(stack.prometheus)
        yield Run(stack, start - 1, time.time(), outcomes)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=30)


def test_promtool_accepts_the_deploy_config_and_rules(run: Run) -> None:
    for rules in sorted(RULES_DIR.glob("*.yml")):
        result = promtool("check", "rules", str(rules))
        assert result.returncode == 0, result.stdout + result.stderr
    for config in (PROMETHEUS_CONFIG, run.stack.prometheus.config_path):
        result = promtool("check", "config", str(config))
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_load_produced_each_kind_of_outcome(run: Run) -> None:
    kinds = {key.split()[0] for key, n in run.outcomes.items() if n}
    assert {"chat", "completion", "long", "flaky", "invalid", "left", "precise", "slo"} <= kinds, run.outcomes
    assert run.outcomes["chat 200"] and run.outcomes["long 200"] and run.outcomes["precise 200"], run.outcomes
    assert run.outcomes["slo 200"], run.outcomes  # an objective nobody meets, served: slo_expected_miss
    assert any(run.outcomes[f"flaky {s}"] for s in (500, 503)), run.outcomes


def test_prometheus_discovers_every_replica_from_the_gateway(run: Run) -> None:
    targets = run.stack.prometheus.api("targets")["activeTargets"]
    replicas = {t["labels"]["endpoint"]: t for t in targets if t["labels"]["job"] == "vllm"}
    expected = {s.url: pool for pool, sims in run.stack.sims.items() for s in sims}
    expected[run.stack.dead_replica] = "dead"
    assert {url: t["labels"]["pool"] for url, t in replicas.items()} == expected
    assert all(replicas[url]["health"] == "up" for url in expected if url != run.stack.dead_replica)
    assert replicas[run.stack.dead_replica]["health"] == "down"
    gateway = [t for t in targets if t["labels"]["job"] == "m3gate" and t["health"] == "up"]
    assert [t["scrapeUrl"] for t in gateway] == [run.stack.gateway.url + "/metrics"]


def test_every_dashboard_expression_has_data(run: Run) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 30 and len({q.panel for q in queries}) >= 20
    exprs = [(f"{q.panel} [{q.legend}]", concrete(q.expr)) for q in queries]
    exprs += [(f"template variable over {series}", series) for series in template_queries()]
    assert run.empty(exprs) == []


def test_every_alert_expression_fires_in_its_failure(run: Run) -> None:
    alerts = alert_rules()
    assert len(alerts) >= 7
    assert run.empty(alerts) == []
    rules = [r for g in run.stack.prometheus.api("rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {name for name, _ in alerts}
    assert [r["name"] for r in rules if r["health"] != "ok"] == []

