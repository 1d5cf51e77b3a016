"""A short run of `python -m loadtests.bench.sessions_e2e`: real agent tool loops (tool-call ids from each answer sent
back with the results) through one gateway and through two gateways sharing a private Redis, with and without
session headers; every session is found whole by m3gate (GET /admin/sessions) and the tool turnaround and think time
it measured match the generator's own waits, per turn, within 5 ms at the p50."""

from __future__ import annotations


import numpy as np
import pytest

from loadtests.bench.sessions_e2e import SCENARIOS, TOLERANCE_MS, markdown, run

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.tools("redis-server")]


def test_m3gate_measures_the_agents_own_tool_and_think_waits_with_and_without_headers_through_one_and_two_gateways(
) -> None:
    rows = run(SCENARIOS, count=6, quick=True)
    report = markdown(rows)
    assert [r["scenario"] for r in rows] == list(SCENARIOS)
    pooled: list[float] = []
    for row in rows:
        diff = row["turnaround_diff_ms"]
        # a session stopped by a failed call (a machine so loaded that a replica misses its health checks) is
        # reported and not compared: at most one
        assert row["failed_sessions"] <= 1, (row["failed_statuses"], report)
        completed = row["sessions"] - row["failed_sessions"]
        # found whole: by header, tool-call ids, history. Without a header through two gateways, a turn that reaches
        # gateway B before gateway A's answer record (one 25 ms flush; later on a starved machine) starts a new
        # session (pools/sessions.py): tolerated once
        slack = 1 if row["scenario"] == "2gw-none" else 0
        assert completed - slack <= row["matched_whole"] <= completed, report
        assert diff["kind_mismatch"] == 0 and diff["compared_turns"] >= 12, report
        assert row["waits"]["tool"]["compared_turns"] and row["waits"]["think"]["compared_turns"], report
        assert abs(diff["p50"]) <= 2 * TOLERANCE_MS, report  # per scenario: ~20-35 turns, noisy on 2 shared cores
        pooled += diff["per_turn"]
    assert abs(float(np.percentile(pooled, 50))) <= TOLERANCE_MS, report  # the target, over all ~100 turns
    assert "## Per session" in report and "## Per turn" in report
