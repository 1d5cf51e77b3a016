"""A real Prometheus scrapes a real gateway and simulated pools under a short load, with deploy/prometheus/'s config
and alert rules; then every PromQL expression of the Grafana dashboard and of the alert rules is evaluated over the
run through Prometheus' HTTP API. Each must parse and return numbers: a panel that stays empty or an alert that
cannot fire under the very failure it is about is a bug. The stack (loadtests/lib/observability_stack.py) is built so that
each failure happens: a slow replica, a failing one, a full KV cache, a dead replica, a dead Redis, a dead gateway.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from loadtests.lib.observability_stack import (
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
from gateway.cli.contract import BOUNDS
from policies.config import GatewayConfig
from policies.contract import build_contract, check, slo_rules, to_html
from tests.support.tools import tools_required

MISSING = [b for b in ("prometheus", "promtool") if shutil.which(b) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(bool(MISSING) and not tools_required(),
                       reason=f"{' and '.join(MISSING)} not installed: run `make prometheus`"),
]
LOAD_SECONDS = 12.0  # long enough that each failure the stack injects is scraped several times on a slow machine
ROOT = Path(__file__).resolve().parents[2]


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
    assert {"chat", "completion", "long", "flaky", "invalid", "left", "precise", "slo", "agent"} <= kinds, run.outcomes
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



# ----------------------------------------------------------------------------------------------------------------
# SLO rules (`m3gate contract --rules`) and the contract check (`m3gate contract --prometheus`) on the same run


def _slo_config(breached: str, healthy: str) -> GatewayConfig:
    """Targets no request can meet (TTFT P95 ≤ 1 ms: the breach, injected) on one class, targets every request
    meets (TTFT P95 and end to end P99 ≤ 10 min) on another."""
    return GatewayConfig.model_validate({
        "model": "m", "pools": [{"name": "p", "max_model_len": 1024}],
        "traffic": {"classes": {
            breached: {"priority": 0, "targets": {"ttft_ms": {"p95": 1}}},
            healthy: {"priority": 1, "ttft_target_s": 600, "targets": {"e2e_ms": {"p99": 600000}}},
        }},
    })


def _inline(alert_expr: str, recording: list[dict[str, Any]], window: str) -> str:
    """An alert expression with each recorded series replaced by its recording expression, every range shortened
    to `window` (the run lasts seconds, the rules' windows hours)."""
    def expand(match: re.Match[str]) -> str:
        name, selector = match[1], match[2]
        labels = dict(re.findall(r'(\w+)="([^"]*)"', selector))
        rule = next(r for r in recording if r["record"] == name and r["labels"] == labels)
        return "(" + re.sub(r"\[\w+\]", f"[{window}]", rule["expr"]) + ")"

    return re.sub(r"(m3gate:slo_errors:ratio_rate\w+)(\{[^}]*\})", expand, alert_expr)


def test_slo_rules_fire_on_an_injected_breach_and_the_contract_check_names_its_stage(run: Run, tmp_path: Any) -> None:
    counts = run.stack.prometheus.api("query", query="sum by (class) (m3gate_time_to_first_token_seconds_count)")
    by_class = sorted(((float(s["value"][1]), s["metric"]["class"]) for s in counts["result"]), reverse=True)
    assert len(by_class) >= 2, by_class
    breached, healthy = by_class[0][1], by_class[1][1]
    config = _slo_config(breached, healthy)
    rules = slo_rules(config, BOUNDS)
    path = tmp_path / "slo.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    recording = rules["groups"][0]["rules"]
    alerts = {a["alert"]: a for a in rules["groups"][1]["rules"]}
    fired = {}
    for name, alert in alerts.items():
        points = finite_points(run.stack.prometheus.query_range(_inline(alert["expr"], recording, "20s"),
                                                                  run.start, run.end))
        fired[name] = points > 0
    assert fired[f"M3gateSLOBurn_{breached}_ttft_p95_1h"] and fired[f"M3gateSLOBurn_{breached}_ttft_p95_6h"], fired
    assert [k for k, v in fired.items() if v and f"_{healthy}_" in k] == [], (breached, healthy, fired)

    from pools.prometheus import observe_classes

    contract = check(build_contract(config), observe_classes(run.stack.prometheus.url, "1m"), "test run")
    verdicts = {(v.cls, v.metric, v.percentile): v for v in contract.verdicts}
    bad = verdicts[(breached, "ttft", "p95")]
    assert bad.status == "FAIL" and bad.dominant_stage in ("gateway queue", "engine queue + prefill"), bad
    assert verdicts[(healthy, "e2e", "p99")].status == "PASS"
    assert "FAIL" in to_html(contract) and "<svg" in to_html(contract)


def test_the_deploy_slo_rules_are_current_and_promtool_unit_tests_pass(tmp_path: Any) -> None:
    """deploy/prometheus/slo/m3gate-slo.yml is what `m3gate contract deploy/compose/pools.yaml --rules` writes; and
    promtool's rule unit test, over the rules' real windows: a class whose every request misses its TTFT P95 pages
    within the hour, a class within its targets stays silent."""
    from gateway.cli.contract import rules_yaml
    from policies.config import load_config

    from policies.contract import to_markdown

    deploy = ROOT / "deploy" / "prometheus" / "slo" / "m3gate-slo.yml"
    compose = load_config(ROOT / "deploy" / "compose" / "pools.yaml")
    regenerate = "regenerate: make contract"
    assert deploy.read_text() == rules_yaml(compose), regenerate
    assert (ROOT / "deploy" / "contract" / "contract.md").read_text() == to_markdown(build_contract(compose)) + "\n", \
        regenerate
    result = promtool("check", "rules", str(deploy))
    assert result.returncode == 0, result.stdout + result.stderr
    ttft = "m3gate_time_to_first_token_seconds"
    series = [
        # interactive: 10 requests a minute, every one over 1 s (its P95 target): all slow.
        {"series": f'{ttft}_bucket{{class="interactive",le="1.0"}}', "values": "0+0x120"},
        {"series": f'{ttft}_count{{class="interactive"}}', "values": "0+10x120"},
        # repository: 10 a minute, all under 2.5 s (its P50 target, the strictest bound).
        {"series": f'{ttft}_bucket{{class="repository",le="2.5"}}', "values": "0+10x120"},
        {"series": f'{ttft}_bucket{{class="repository",le="10.0"}}', "values": "0+10x120"},
        {"series": f'{ttft}_bucket{{class="repository",le="20.0"}}', "values": "0+10x120"},
        {"series": f'{ttft}_count{{class="repository"}}', "values": "0+10x120"},
    ]
    test = {
        "rule_files": [str(deploy)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "30m", "alertname": "M3gateSLOBurn_interactive_ttft_p95_1h", "exp_alerts": [{
                    "exp_labels": {"severity": "page", "class": "interactive", "slo": "ttft_p95",
                                   "long_window": "1h", "short_window": "5m"},
                    "exp_annotations": alert_annotations(deploy, "M3gateSLOBurn_interactive_ttft_p95_1h"),
                }]},
                {"eval_time": "30m", "alertname": "M3gateSLOBurn_repository_ttft_p95_1h", "exp_alerts": []},
                {"eval_time": "30m", "alertname": "M3gateSLOBurn_repository_ttft_p50_3d", "exp_alerts": []},
            ],
        }],
    }
    path = tmp_path / "slo-test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False, allow_unicode=True))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def alert_annotations(path: Any, name: str) -> dict[str, str]:
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == name:
                return dict(rule["annotations"])
    raise KeyError(name)
