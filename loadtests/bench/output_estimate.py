"""How close the output-length estimate comes to the real output, beside the budget it replaces.

`python -m loadtests.bench.output_estimate [--quick] [--out DIR]` replays a synthetic coding-agent trace through
`policies.output_estimate.OutputEstimator` online (each request estimated at its arrival, each answer learnt at its
end, in time order, sessions interleaved) and reports, side by side on the same requests:

- `max_tokens`: the budget (the caller's max_tokens, else the thinking mode's default reserve) as the output length,
  what load scoring counted before;
- `prior`: the bucket's representative count from the request's fields alone (no learning);
- `estimate`: the prior refined by the session's, key's and class's recent outputs (what the gateway uses).

For each: the bucket's precision and recall (short / medium / long, split where the estimator splits them), the
median absolute error in tokens, and Σ predicted ÷ Σ actual (how far the in-flight token count, which load scoring
reads, overstates the work).

The trace: agent sessions of 5–40 turns (tools offered, `tool_choice` auto, a tenth of the turns forcing a call),
some chat sessions without tools, a few thinking-enabled ones with a thinking budget; thinking adaptive, disabled or
enabled; each answer log-normal around its kind's median (a tool call ~80 tokens, a final answer ~450, thinking
~1,500 or most of its budget), times a per-session verbosity, with a long tail (one answer in thirty runs 4–12×
longer); capped by its budget. Its median output is ~200–300 tokens, as agent traces report.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.lib.harness import run_dir
from loadtests.lib.results import Results

from policies.config import OutputBudgetConfig, OutputEstimateConfig
from policies.output_estimate import BUCKETS, OutputEstimator, OutputHints, output_hints

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


@dataclass(slots=True)
class Turn:
    at: float  # arrival, seconds
    session: str
    key: str
    cls: str
    hints: OutputHints
    actual: int  # output tokens the answer has
    typical: int  # the median of the distribution it was drawn from (what a perfect estimate would say)


def _body(rng: random.Random, kind: str, mode: str) -> dict[str, Any]:
    """The request fields the estimate reads, for one turn of a session of `kind`."""
    body: dict[str, Any] = {"chat_template_kwargs": {"thinking_mode": mode}}
    if kind == "agent":
        body["tools"] = TOOLS
        body["tool_choice"] = "required" if rng.random() < 0.1 else "auto"
    if mode == "enabled" and rng.random() < 0.5:
        body["chat_template_kwargs"]["thinking_budget"] = rng.choice((1024, 2048, 4096))
    if rng.random() < 0.5:
        body["max_tokens"] = rng.choice((8192, 16384, 32768))
    return body


def _actual(rng: random.Random, body: dict[str, Any], mode: str, verbosity: float, budget: int) -> tuple[int, int]:
    """The answer's length and its distribution's median: log-normal around its kind's median, the session's
    verbosity, a long tail."""
    if body.get("tool_choice") == "required":
        median = 70.0
    elif body.get("tools") and rng.random() < 0.7:
        median = 90.0  # a tool call
    else:
        median = 450.0 if mode != "disabled" else 250.0  # a final answer
    if mode == "enabled":
        thinking = body["chat_template_kwargs"].get("thinking_budget")
        median += 0.7 * thinking if thinking else 1200.0
    elif mode == "adaptive" and rng.random() < 0.3:
        median += 400.0  # it chose to think
    typical = median * verbosity
    tokens = typical * math.exp(rng.gauss(0.0, 0.5))
    if rng.random() < 1 / 30:
        tokens *= rng.uniform(4.0, 12.0)
    return max(1, min(budget, round(tokens))), max(1, min(budget, round(typical)))


def trace(sessions: int, seed: int) -> list[Turn]:
    """Sessions spread over an hour, each on one of a few keys, turns 5–60 s apart."""
    rng = random.Random(seed)
    defaults = OutputBudgetConfig()
    turns: list[Turn] = []
    for n in range(sessions):
        kind = rng.choices(("agent", "chat"), (0.8, 0.2))[0]
        mode = rng.choices(("adaptive", "disabled", "enabled"), (0.6, 0.25, 0.15))[0]
        key, cls = f"k{rng.randrange(8)}", "agents" if kind == "agent" else "chat"
        verbosity = math.exp(rng.gauss(0.0, 0.5))
        at = rng.uniform(0.0, 3600.0)
        for _ in range(rng.randint(5, 40)):
            body = _body(rng, kind, mode)
            budget = body.get("max_tokens") or defaults.for_mode(mode)  # type: ignore[arg-type]
            hints = output_hints(body, mode, budget)
            turns.append(Turn(at, f"s{n}", key, cls, hints, *_actual(rng, body, mode, verbosity, budget)))
            at += rng.uniform(5.0, 60.0)
    turns.sort(key=lambda t: t.at)
    return turns


def replay(turns: list[Turn], cfg: OutputEstimateConfig) -> dict[str, list[int]]:
    """Each turn's prediction by each method, online: answers are learnt when they end (arrival + ~20 ms a token)."""
    est = OutputEstimator((cfg.short_tokens, cfg.medium_tokens, cfg.long_tokens), ttl_s=cfg.ttl_s,
                          max_sessions=cfg.max_sessions)
    out: dict[str, list[int]] = {"max_tokens": [], "prior": [], "estimate": [], "oracle": [t.typical for t in turns]}
    ends: list[tuple[float, int]] = []  # (end time, turn index)
    for i, t in enumerate(turns):
        while ends and ends[0][0] <= t.at:
            _, j = heapq.heappop(ends)
            done = turns[j]
            est.observe(done.hints, done.actual, done.at, done.session, done.key, done.cls)
        out["max_tokens"].append(t.hints.budget)
        out["prior"].append(min(t.hints.budget, est.prior_tokens(t.hints)))
        out["estimate"].append(est.estimate(t.hints, t.at, t.session, t.key, t.cls).tokens)
        heapq.heappush(ends, (t.at + 0.5 + 0.02 * t.actual, i))
    return out


def score(predicted: list[int], actual: list[int], est: OutputEstimator) -> dict[str, Any]:
    """Per-bucket precision and recall, the median absolute error, Σ predicted ÷ Σ actual."""
    pairs = [(est.bucket(p), est.bucket(a)) for p, a in zip(predicted, actual)]
    row: dict[str, Any] = {}
    for b in BUCKETS:
        said = sum(1 for p, _ in pairs if p == b)
        real = sum(1 for _, a in pairs if a == b)
        hit = sum(1 for p, a in pairs if p == a == b)
        row[b] = (hit / said if said else None, hit / real if real else None)
    row["accuracy"] = sum(1 for p, a in pairs if p == a) / len(pairs)
    row["mae"] = statistics.median(abs(p - a) for p, a in zip(predicted, actual))
    row["overcount"] = sum(predicted) / sum(actual)
    return row


def _pct(value: float | None) -> str:
    return "   -" if value is None else f"{100 * value:4.0f}"


def results_of(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> Results:
    """Each method's bucket accuracy, median error and Σ ratio; the estimate's error and accuracy are judged against
    the budget it replaces (its reason to exist), in the one results format."""
    results = Results("output_estimate", vars(args), reference="max_tokens (the budget) on the same requests")
    base, ours = rows["max_tokens"], rows["estimate"]
    results.add("estimate: median absolute error", ours["mae"], "tokens", goal="< max_tokens'",
                passed=ours["mae"] < base["mae"], reference="max_tokens", reference_value=base["mae"])
    results.add("estimate: bucket accuracy", 100 * ours["accuracy"], "%", goal="> max_tokens'",
                passed=ours["accuracy"] > base["accuracy"], reference="max_tokens",
                reference_value=100 * base["accuracy"])
    for name, row in rows.items():
        if name != "estimate":
            results.add(f"{name}: median absolute error", row["mae"], "tokens")
            results.add(f"{name}: bucket accuracy", 100 * row["accuracy"], "%")
        results.add(f"{name}: Σ predicted ÷ Σ actual", row["overcount"], "×")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=2000, help="sessions in the trace (default 2000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="200 sessions")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default loadtests/results/<time>-"
                                                                "output-estimate/)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = OutputEstimateConfig()
    turns = trace(200 if args.quick else args.sessions, args.seed)
    actual = [t.actual for t in turns]
    est = OutputEstimator((cfg.short_tokens, cfg.medium_tokens, cfg.long_tokens))
    low, high = est.bounds
    real = {b: sum(1 for a in actual if est.bucket(a) == b) / len(actual) for b in BUCKETS}
    print(f"{len(turns):,} requests in {len({t.session for t in turns}):,} sessions; output tokens median "
          f"{statistics.median(actual):.0f}, p90 {sorted(actual)[int(0.9 * len(actual))]:,}, mean "
          f"{statistics.fmean(actual):.0f}; buckets short < {low:.0f} ≤ medium < {high:.0f} ≤ long: "
          + ", ".join(f"{b} {100 * real[b]:.0f}%" for b in BUCKETS))
    print("precision / recall per bucket (%), accuracy (%), median |predicted − actual| (tokens), Σ predicted ÷ Σ actual")
    print(f"{'method':>10} " + " ".join(f"{b:>11}" for b in BUCKETS) + f" {'accuracy':>8} {'MAE':>7} {'Σ ratio':>8}")
    rows = {name: score(predicted, actual, est) for name, predicted in replay(turns, cfg).items()}
    for name, row in rows.items():
        cells = " ".join(f"{_pct(row[b][0])} / {_pct(row[b][1])}" for b in BUCKETS)
        print(f"{name:>10} {cells} {100 * row['accuracy']:>8.0f} {row['mae']:>7.0f} {row['overcount']:>8.2f}")
    base, ours = rows["max_tokens"], rows["estimate"]
    print(f"estimate vs max_tokens: median absolute error {ours['mae']:.0f} vs {base['mae']:.0f} tokens "
          f"({base['mae'] / max(ours['mae'], 1e-9):.0f}× smaller), bucket accuracy {100 * ours['accuracy']:.0f}% vs "
          f"{100 * base['accuracy']:.0f}%")
    folder = args.out or run_dir("output-estimate")
    results_of(rows, args).write(folder)
    print(f"results: {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
