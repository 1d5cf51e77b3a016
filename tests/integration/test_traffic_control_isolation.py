"""Isolation between traffic classes: a burst of long requests that saturates the repository pool raises interactive
time-to-first-token p95 by at most 20% (a bounded run of loadtests/bench/isolation.py, with vLLM-like simulated
timing: two phases of 6 s at 8 interactive requests per second, a burst of 32 ~15K-token jobs)."""

from __future__ import annotations

import statistics

import pytest

from loadtests.bench.isolation import TARGET_RATIO, run

pytestmark = pytest.mark.slow


RUNS = 3


def test_a_repository_burst_does_not_slow_interactive_first_tokens() -> None:
    # The test host is shared: a neighbour's CPU spike in one phase can move a p95 of 48 samples on its own. The
    # median of three runs absorbs one such run either way; a real regression (the gateway or the pools no longer
    # isolating) moves every run. Once two runs fall on the same side of the target the third cannot move the median
    # across it, so it is not run (the median of those two is then on that side too).
    ratios: list[float] = []
    for _ in range(RUNS):
        result = run(rate=8.0, seconds=6.0, burst=32, repo_concurrency=4)
        print("\n" + result.report())
        assert result.burst_upstream == 4, "the repository class limit should hold exactly 4 long jobs upstream"
        assert len(result.baseline) == len(result.burst) == 48
        ratios.append(result.ratio)
        within = sum(r <= TARGET_RATIO for r in ratios)
        if max(within, len(ratios) - within) > RUNS // 2:
            break
    assert statistics.median(ratios) <= TARGET_RATIO, [round(r, 3) for r in ratios]
