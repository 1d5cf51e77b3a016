"""The fuzz suite's CI size (`make fuzz` runs 10,000 cases): ~1,500 hostile and malformed requests against a live
gateway (schemathesis from deploy/openapi.yaml, hypothesis mutations, the hand-written corpus) plus the
connection-level attacks, with the targets as assertions."""

from __future__ import annotations


import pytest

from loadtests.robustness.fuzz import RSS_TOLERANCE, Report, run_fuzz, summary
from loadtests.lib.harness import RESULTS_DIR

pytestmark = [
    pytest.mark.fuzz,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.tools("redis-server"),
]


@pytest.fixture(scope="module")
def report() -> Report:
    result = run_fuzz(1500, idle_connections=300, log=lambda _line: None)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "fuzz-ci.md").write_text(summary(result) + "\n")
    print("\n" + summary(result))
    return result


def test_enough_cases_ran(report: Report) -> None:
    assert report.cases >= 1400
    assert {"corpus", "schemathesis", "mutation"} <= set(report.by_source)


def test_no_5xx_from_the_gateway_itself(report: Report) -> None:
    assert report.gateway_own_5xx == 0, report.examples
    # what it made of replica trouble (a replica resetting connections after its own 500): rare, never a cascade
    assert report.gateway_5xx - report.gateway_own_5xx <= 2, report.examples


def test_every_4xx_is_openai_shaped(report: Report) -> None:
    assert report.bad_error_shape == 0, report.examples


def test_no_crash_and_no_dropped_connection(report: Report) -> None:
    assert report.gateway_alive
    assert report.no_answer == 0, report.examples
    assert report.tracebacks == 0


def test_image_urls_are_never_fetched_by_the_gateway(report: Report) -> None:
    assert report.outbound_connections == []


@pytest.mark.parametrize("kind", ["10 MB", "200 MB body (Content-Length)", "200 MB body (chunked)", "slowloris",
                                  "connections that never send", "raw:"])
def test_connection_level_attacks(report: Report, kind: str) -> None:
    matching = [a for a in report.attacks if kind in a["name"]]
    assert matching
    assert all(a["ok"] for a in matching), matching


def test_memory_and_descriptors_back_to_baseline(report: Report) -> None:
    assert report.rss_growth <= RSS_TOLERANCE, summary(report)
    assert report.fds_after <= report.fds_baseline + 8, summary(report)
