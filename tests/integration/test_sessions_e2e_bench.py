"""A short run of `python -m loadtests.bench_sessions_e2e`: real agent tool loops (tool-call ids from each answer sent
back with the results) through one gateway and through two gateways sharing a private Redis, with and without
session headers; every session is found whole by m3gate (GET /admin/sessions) and the tool turnaround and think time
it measured match the generator's own waits, per turn, within 5 ms at the p50."""

from __future__ import annotations

import shutil

import pytest

from loadtests.bench_sessions_e2e import SCENARIOS, TOLERANCE_MS, markdown, run

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")]


def test_m3gate_measures_the_agents_own_tool_and_think_waits_with_and_without_headers_through_one_and_two_gateways(
) -> None:
    rows = run(SCENARIOS, count=6, quick=True)
    report = markdown(rows)
    assert [r["scenario"] for r in rows] == list(SCENARIOS)
    for row in rows:
        diff = row["turnaround_diff_ms"]
        assert row["failed_turns"] == 0, report
        assert row["matched_whole"] == row["sessions"] == 6, report  # found whole: by header, tool-call ids, history
        assert diff["kind_mismatch"] == 0 and diff["compared_turns"] >= 18, report
        assert row["waits"]["tool"]["compared_turns"] and row["waits"]["think"]["compared_turns"], report
        assert abs(diff["p50"]) <= TOLERANCE_MS, report
        assert row["pass"], report
    assert "## Per session" in report and "## Per turn" in report
