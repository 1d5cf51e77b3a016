"""`python -m loadtests run WORKLOAD --contract`: the operating contract checked against a short load test through
a started gateway: a target no request can meet fails with its dominant stage, one every request meets passes, and
the contract, verdicts and plots are written beside the run's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.__main__ import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_load_test_checks_the_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    rc = main(["run", "smoke", "--set", "max_requests=12", "--contract",
               "--contract-targets", "{ttft_ms: {p50: 0.001, p99: 600000}, e2e_ms: {p95: 600000}}",
               "--no-plots", "--no-progress", "--out", str(out)])
    assert rc == 1  # the impossible TTFT P50 fails
    report = json.loads((out / "contract" / "contract.json").read_text())
    verdicts = {(v["metric"], v["percentile"]): v for v in report["verdicts"]}
    assert verdicts[("ttft", "p50")]["status"] == "FAIL"
    assert verdicts[("ttft", "p50")]["dominant_stage"] in ("gateway queue", "engine queue + prefill")
    assert verdicts[("ttft", "p99")]["status"] == "PASS" and verdicts[("e2e", "p95")]["status"] == "PASS"
    assert verdicts[("ttft", "p50")]["samples"] > 0
    assert "<svg" in (out / "contract" / "contract.html").read_text()
    assert "## Check — FAIL" in capsys.readouterr().out
