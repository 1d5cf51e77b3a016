"""Calibrated latency predictions: each pool's engine cost learnt online, a virtual clock of each replica's prefill
steps, and a P90 calibrated on the errors.

The median. vLLM prefills in engine steps: the requests waiting when a step starts go into it together (up to the
token budget), and a step costs about `a + c · tokens` (a fixed step cost, c per uncached prompt token). The gateway
knows every prompt it sent each replica and when, so it keeps a virtual clock of the replica's steps
(`prefill_plan`): a request sent to an idle replica starts a step now; one sent while the replica's next step has not
started joins it; one sent while the last step runs starts a step after it. Its TTFT is the end of its step. `a` and
`c` are learnt per pool (`PrefillCost`: recursive least squares on the relative error, forgetting old samples)
from the requests' own first tokens, so the clock runs at the pool's real speed; the wait ahead is capped by what the
gateway knows is still queued there (uncached tokens not yet at their first token), so an overestimate cannot
compound into a runaway clock.
Measured on bench_slo's traces (replayed offline, then in the gateway): TTFT MAPE 16–21% against 35–44% for the
earlier log-linear correction of the "work ahead" estimate, whose in-sample least-squares optimum was ~31%: batching
and elapsed time were what that estimate could not see.

The P90. `TtftCalibrator` learns log(TTFT) ≈ k · [1, log(median), uncached/8K, waiting/8, running/16, kv_usage] at
q = 0.9 by online quantile regression (a pinball-loss SGD step per finished stream), floored by the median × the
running 0.9-quantile of the median's log residuals. A fresh model's P90 is 1.5 × the median. Plain SGD and RLS rather
than a library model: a handful of coefficients, a step costs a few µs, a prediction is a dot product (the routing
decision must stay within 1.5× of its cost before predictions), and there is nothing to pickle or retrain in a thread.

How many tokens a request will generate is policies/output_estimate.py's.

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


class PrefillCost:
    """One pool's engine step cost, `a + c · tokens` seconds, learnt by recursive least squares on the relative
    error (each sample weighted 1/actual, so short and long prompts count alike) with forgetting factor `forget`
    (the last ~1/(1 − forget) samples weigh most: a replica restart or a reload that changes the hardware is
    followed). Starts at a = 20 ms, c = 60 µs/token (the routing defaults) with a wide uncertainty, so the first few
    answers set it."""

    __slots__ = ("a", "c", "_p", "forget", "samples")

    def __init__(self, a: float = 0.02, c_per_1k: float = 0.06, forget: float = 0.995) -> None:
        self.a = a  # seconds per step
        self.c = c_per_1k  # seconds per 1,000 tokens (a scale RLS keeps well conditioned)
        self._p = [1.0, 0.0, 0.0, 1.0]  # the 2×2 inverse-information matrix, row-major
        self.forget = forget
        self.samples = 0

    def seconds(self, tokens: float) -> float:
        """One step holding `tokens` uncached prompt tokens."""
        return self.a + self.c * tokens * 1e-3

    def learn(self, tokens: float, step_s: float, actual_s: float) -> None:
        """A request's step held `tokens` and took `step_s` (its TTFT less the wait before its step began)."""
        if not (step_s > 0.0 and actual_s > 0.0 and math.isfinite(step_s) and math.isfinite(actual_s)):
            return
        w = 1.0 / actual_s
        x0, x1 = w, tokens * 1e-3 * w
        y = step_s * w
        p00, p01, p10, p11 = self._p
        px0, px1 = p00 * x0 + p01 * x1, p10 * x0 + p11 * x1
        denom = self.forget + x0 * px0 + x1 * px1
        k0, k1 = px0 / denom, px1 / denom
        err = y - (self.a * x0 + self.c * x1)
        a, c = self.a + k0 * err, self.c + k1 * err
        if a > 0.0 and c > 0.0:  # a sample that would make the engine free or negative is noise, not news
            self.a, self.c = a, c
        f = self.forget
        self._p = [(p00 - k0 * px0) / f, (p01 - k0 * px1) / f, (p10 - k1 * px0) / f, (p11 - k1 * px1) / f]
        self.samples += 1

    def view(self) -> dict[str, float]:
        return {"step_s": round(self.a, 5), "s_per_1k_tokens": round(self.c, 5), "samples": self.samples}


class DecodeCost:
    """One pool's decode step time, `d0 + d1 · batch + d2 · batch · context/1K` seconds (a fixed step cost, a cost per
    sequence in the batch, a cost per 1,000 tokens of KV each sequence reads), learnt from the streams' inter-token
    gaps the way `PrefillCost` learns the prefill step: recursive least squares on the relative error with
    forgetting factor `forget`. A stream's mean gap is one sample of the step time at the batch its replica ran
    (vLLM's num_requests_running, else the gateway's own in-flight count) and its mean context. Starts at 20 ms a
    step (the replicas' TPOT default) growing 0.2 ms per sequence and 0.02 ms per sequence per 1K context, with a
    wide uncertainty so the first streams set it; the uncertainty is bounded (`P_MAX`) so that a long spell at one
    batch size cannot wind it up into a jump when the batch changes."""

    __slots__ = ("coef", "_p", "forget", "samples")
    P_MAX = 100.0

    def __init__(self, d0: float = 0.02, d1: float = 2e-4, d2: float = 2e-5, forget: float = 0.995) -> None:
        self.coef = [d0, d1, d2]
        self._p = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]  # the 3×3 inverse-information matrix, row-major
        self.forget = forget
        self.samples = 0

    def seconds(self, batch: float, context: float) -> float:
        """One decode step with `batch` sequences of `context` tokens each on average: the time per output token."""
        d0, d1, d2 = self.coef
        return d0 + batch * (d1 + d2 * context * 1e-3)

    def per_sequence(self, context: float) -> float:
        """What one more sequence of `context` tokens adds to a step."""
        return self.coef[1] + self.coef[2] * context * 1e-3

    def learn(self, batch: float, context: float, step_s: float) -> None:
        """A stream's mean inter-token gap `step_s`, at `batch` sequences of mean `context` tokens (unrolled: this
        runs once per finished stream)."""
        if not (step_s > 0.0 and batch > 0.0 and context >= 0.0 and math.isfinite(step_s)):
            return
        w = 1.0 / step_s
        x0, x1 = w, batch * w
        x2 = x1 * context * 1e-3
        p00, p01, p02, p10, p11, p12, p20, p21, p22 = self._p
        q0 = p00 * x0 + p01 * x1 + p02 * x2
        q1 = p10 * x0 + p11 * x1 + p12 * x2
        q2 = p20 * x0 + p21 * x1 + p22 * x2
        denom = self.forget + x0 * q0 + x1 * q1 + x2 * q2
        k0, k1, k2 = q0 / denom, q1 / denom, q2 / denom
        d0, d1, d2 = self.coef
        err = 1.0 - (d0 * x0 + d1 * x1 + d2 * x2)  # y = step_s · w = 1
        d0, d1, d2 = d0 + k0 * err, d1 + k1 * err, d2 + k2 * err
        if d0 > 0.0 and d1 >= 0.0 and d2 >= 0.0:  # a free or negative engine is noise, not news
            self.coef = [d0, d1, d2]
        f = 1.0 / self.forget
        fresh = [(p00 - k0 * q0) * f, (p01 - k0 * q1) * f, (p02 - k0 * q2) * f,
                 (p10 - k1 * q0) * f, (p11 - k1 * q1) * f, (p12 - k1 * q2) * f,
                 (p20 - k2 * q0) * f, (p21 - k2 * q1) * f, (p22 - k2 * q2) * f]
        trace = fresh[0] + fresh[4] + fresh[8]
        if trace > self.P_MAX:
            scale = self.P_MAX / trace
            fresh = [v * scale for v in fresh]
        self._p = fresh
        self.samples += 1

    def view(self) -> dict[str, float]:
        d0, d1, d2 = self.coef
        return {"step_s": round(d0, 6), "s_per_sequence": round(d1, 7), "s_per_sequence_1k_context": round(d2, 7),
                "samples": self.samples}


def prefill_plan(cost: PrefillCost, starts_in: float, ends_in: float, step_tokens: int, uncached: int,
                 queued: int) -> tuple[float, int, float]:
    """Where a request sent now lands in the replica's virtual step clock: (wait before its step starts, tokens in its
    step, predicted TTFT), seconds from now. `starts_in` / `ends_in`: the last planned step's start and end from now,
    `step_tokens` its tokens; `queued`: uncached tokens the gateway sent the replica that have not reached their
    first token (the cap: everything queued plus this request, in two steps, is the most the wait can be)."""
    if ends_in <= 0.0:
        # idle by the clock: a step of its own, now. Unless first tokens of what was sent have not come: the engine
        # runs behind the clock (a fresh pool's cost, a slow spell), and half of what is queued is taken to be left
        offset, tokens = (0.5 * cost.seconds(queued) if queued > 0 else 0.0), uncached
    elif starts_in > 0.0:  # that step has not started: join it
        offset, tokens = starts_in, step_tokens + uncached
    else:  # that step runs: the next one, after it
        offset, tokens = ends_in, uncached
    ttft = offset + cost.seconds(tokens)
    cap = cost.seconds(queued + uncached) + cost.a
    if ttft > cap:
        ttft = cap
        if offset > cap:
            offset = cap
    elif queued:
        # nor can it be done before a share of what is queued ahead (FCFS: the queued work is partly prefilled
        # already, so a quarter): a clock that runs fast (a fresh pool, a cost learnt on short prompts) is held back
        floor = 0.25e-3 * cost.c * queued + cost.seconds(uncached)
        if ttft < floor:
            offset += floor - ttft
            ttft = floor
    return offset, tokens, ttft


class TtftCalibrator:
    """One pool's TTFT model: `cost` (the engine step cost behind the median, `prefill_plan`), `predict(x) ->
    (median_s, p90_s)`, `learn(x, actual_s)`; x = ttft_features(median, ...).

    The P90 is the larger of its own quantile regression and the median × exp(spread), where spread is the running
    0.9-quantile of the median's log residuals (one scalar, stochastic approximation at `spread_lr`). The regression
    alone lags when the load shifts (each step moves it by lr·q at most): on bench_slo's bursty traces its coverage
    was 0.73–0.83, with the spread floor 0.81–0.87 overall and 0.89–0.94 once warmed up (target 0.85–0.95)."""

    def __init__(self, lr: float = 0.05, p90_start: float = 1.5, spread_lr: float = 0.1) -> None:
        self.lr = lr
        self.cost = PrefillCost()
        self.p90 = _Quantile(0.9, [math.log(p90_start), 1.0, 0.0, 0.0, 0.0, 0.0])
        self.spread = math.log(p90_start)  # 0.9-quantile of log(actual) − log(median prediction)
        self.spread_lr = spread_lr

    @property
    def samples(self) -> int:
        return self.p90.samples

    def learn_cost(self, tokens: int, step_s: float, actual_s: float) -> None:
        """A first token came: what its step took (`prefill_plan`'s step tokens; the TTFT less the wait before it)."""
        self.cost.learn(tokens, step_s, actual_s)

    def predict(self, x: Sequence[float]) -> tuple[float, float]:
        log_median = x[1]  # the virtual clock's TTFT, already in the pool's measured engine cost
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
        self.spread += self.spread_lr * (0.9 - (1.0 if y - x[1] <= self.spread else 0.0))
        # A decaying step: large while the model is far off, small once it has seen enough to be trusted.
        lr = self.lr * max(0.2, 1.0 / math.sqrt(1.0 + self.p90.samples / 200.0))
        self.p90.step(x, y, lr)

    def coefficients(self) -> dict[str, Any]:
        return {"cost": self.cost.view(), "p90": [round(c, 4) for c in self.p90.coef],
                "spread": round(self.spread, 4)}

