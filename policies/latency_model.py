"""Calibrated latency predictions: the analytic TTFT model corrected online, per pool, into a median and a P90.

`policies/replica_choice.py` predicts each replica's time to first token analytically (queue ahead + prefill of the
uncached prompt, from EWMA rates). Nobody measured how wrong that is, and one number says nothing about the spread an
SLO has to survive. `TtftCalibrator` learns, per pool, from the requests the gateway itself serves, a correction of
that prediction into two quantiles:

    log(TTFT) ≈ c · [1, log(analytic), uncached/8K, waiting/8, running/16, kv_usage]      at q = 0.5 and q = 0.9

by online quantile regression (stochastic gradient on the pinball loss, one step per finished request). It starts as
the analytic model itself (median = analytic, P90 = 2 × analytic) and moves only as far as the evidence pushes it,
so a fresh pool, a reload or a restarted replica never routes on a model trained on nothing. Plain SGD rather than a
learnt library model: six coefficients per quantile are enough to fix the analytic model's biases (it misprices
queues of cache hits and batch interference), a step costs ~2 µs, prediction is one dot product per candidate (the
routing decision must stay within 1.5× of today's cost), and there is nothing to pickle or retrain in a thread.

`OutputLengths` predicts how many tokens a request will generate, per traffic class and thinking mode (thinking
multiplies it), for end-to-end and decode-load predictions instead of assuming the whole budget.

Pure: no I/O, no clock; the gateway feeds samples and reads predictions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

N_FEATURES = 6
_EPS = 1e-3  # seconds: keeps log() finite for instant answers


def ttft_features(analytic_s: float, uncached_tokens: int, waiting: float, running: float,
                  kv_usage: float | None) -> tuple[float, ...]:
    """The model's inputs for one replica at decision time (all cheap: already computed by the policy)."""
    return (1.0, math.log(analytic_s + _EPS), uncached_tokens / 8192.0, waiting / 8.0, running / 16.0,
            kv_usage or 0.0)


@dataclass(slots=True)
class _Quantile:
    q: float
    coef: list[float]
    samples: int = 0

    def predict_log(self, x: Sequence[float]) -> float:
        c = self.coef
        return c[0] * x[0] + c[1] * x[1] + c[2] * x[2] + c[3] * x[3] + c[4] * x[4] + c[5] * x[5]

    def step(self, x: Sequence[float], y: float, lr: float) -> None:
        """One pinball-loss gradient step in log space: under-predictions push up with weight q, over-predictions
        down with weight 1 − q, so the fit settles where a share q of the samples lies below it."""
        residual = y - self.predict_log(x)
        g = lr * (self.q if residual > 0 else self.q - 1.0)
        c = self.coef
        for i in range(N_FEATURES):
            c[i] += g * x[i]
        self.samples += 1


class TtftCalibrator:
    """One pool's TTFT model: `predict(x) -> (median_s, p90_s)`, `learn(x, actual_s)`.

    The P90 is the larger of its own quantile regression and the median × exp(spread), where spread is the running
    0.9-quantile of the median's log residuals (one scalar, stochastic approximation at `spread_lr`). The regression
    alone lags when the load shifts (each step moves it by lr·q at most): on bench_slo's bursty traces its coverage
    was 0.73–0.83, with the spread floor 0.81–0.87 overall and 0.89–0.94 once warmed up (target 0.85–0.95)."""

    def __init__(self, lr: float = 0.05, p90_start: float = 2.0, spread_lr: float = 0.1) -> None:
        self.lr = lr
        self.median = _Quantile(0.5, [0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
        self.p90 = _Quantile(0.9, [math.log(p90_start), 1.0, 0.0, 0.0, 0.0, 0.0])
        self.spread = math.log(p90_start)  # 0.9-quantile of log(actual) − log(median prediction)
        self.spread_lr = spread_lr

    @property
    def samples(self) -> int:
        return self.median.samples

    def predict(self, x: Sequence[float]) -> tuple[float, float]:
        log_median = self.median.predict_log(x)
        median = math.exp(log_median) - _EPS
        log_p90 = self.p90.predict_log(x)
        floor = log_median + self.spread
        p90 = math.exp(log_p90 if log_p90 > floor else floor) - _EPS
        median = median if median > 0.0 else 0.0
        return median, (p90 if p90 > median else median)

    def predict_p90(self, x: Sequence[float]) -> float:
        return self.predict(x)[1]

    def learn(self, x: Sequence[float], actual_s: float) -> None:
        if not (actual_s >= 0.0 and math.isfinite(actual_s)):
            return
        y = math.log(actual_s + _EPS)
        self.spread += self.spread_lr * (0.9 - (1.0 if y - self.median.predict_log(x) <= self.spread else 0.0))
        # A decaying step: large while the model is far off, small once it has seen enough to be trusted.
        lr = self.lr * max(0.2, 1.0 / math.sqrt(1.0 + self.median.samples / 200.0))
        self.median.step(x, y, lr)
        self.p90.step(x, y, lr)

    def coefficients(self) -> dict[str, Any]:
        return {"median": [round(c, 4) for c in self.median.coef], "p90": [round(c, 4) for c in self.p90.coef],
                "spread": round(self.spread, 4)}


class OutputLengths:
    """Completion tokens per (class, thinking mode): an EWMA per key, the request's budget until one is known."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self._mean: dict[tuple[str, str], float] = {}

    def predict(self, cls: str, thinking_mode: str, budget: int) -> int:
        mean = self._mean.get((cls, thinking_mode))
        return budget if mean is None else min(budget, max(1, round(mean)))

    def observe(self, cls: str, thinking_mode: str, completion_tokens: int) -> None:
        if completion_tokens <= 0:
            return
        key = (cls, thinking_mode)
        mean = self._mean.get(key)
        self._mean[key] = float(completion_tokens) if mean is None else mean + self.alpha * (completion_tokens - mean)

    def view(self) -> dict[str, float]:
        return {f"{cls}/{mode}": round(mean, 1) for (cls, mode), mean in self._mean.items()}
