"""loadtests/bench/output_estimate.py on a small trace: the estimate is closer to the real outputs than the budget
and than the request's fields alone, and never above a request's budget."""

from __future__ import annotations

from loadtests.bench.output_estimate import main, replay, score, trace
from policies.config import OutputEstimateConfig
from policies.output_estimate import OutputEstimator


def test_learning_beats_the_prior_which_beats_the_budget() -> None:
    turns = trace(150, seed=3)
    actual = [t.actual for t in turns]
    predicted = replay(turns, OutputEstimateConfig())
    est = OutputEstimator()
    rows = {name: score(values, actual, est) for name, values in predicted.items()}
    assert rows["estimate"]["mae"] < rows["prior"]["mae"] < rows["max_tokens"]["mae"] / 10
    assert rows["estimate"]["accuracy"] > rows["prior"]["accuracy"] > rows["max_tokens"]["accuracy"]
    assert all(p <= t.hints.budget for p, t in zip(predicted["estimate"], turns))


def test_quick_run_prints_the_comparison(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "estimate vs max_tokens" in out and "oracle" in out
