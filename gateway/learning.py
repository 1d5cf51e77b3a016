"""What answers teach the gateway's estimates, in one place.

Four feeds, each at the moment it has something to learn from:

- a stream's first token: the engine step cost behind a replica's virtual step clock (`TtftCalibrator.learn_cost`),
  at once rather than when the stream ends, because the next requests are routed on it;
- a replica refusing a prompt as longer than its context: the count it reports teaches the pool's token-estimate
  ratio (policies/estimates.py);
- a request's end: the replica's prefill rate and time per output token (`Replica.observe_latency`), then the
  estimate ratio from the answer's usage, the pool's TTFT calibration and the output-length estimates (its session's,
  key's and class's; policies/output_estimate.py), which `expected_output` reads when a request is admitted.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from gateway.record import RequestRecord
from gateway.runtime import Gateway
from policies.classify import RequestProfile
from policies.output_estimate import OutputHints, output_hints
from policies.replica_choice import RoutingDecision
from pools.replicas import Replica

log = logging.getLogger("m3gate")


class OutputBasis(NamedTuple):
    """What a request's output estimate rested on: its hints and the scopes it learns into."""

    hints: OutputHints
    session: str  # "" when it has none
    key: str


class Learning:
    """The gateway's estimates, fed from answers (see the module's docstring)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    def first_token(self, record: RequestRecord, decision: RoutingDecision | None, replica: Replica) -> None:
        """A stream's first token arrived from the replica its routing decision planned a prefill step on."""
        plan = decision.prefill_plan if decision is not None else None
        if plan is None or decision is None or decision.replica != replica.url:
            return
        model = self.gw.latency.get(record.pool)
        if model is not None:
            actual = record.t_first_byte - record.t_sent
            model.learn_cost(plan[1], actual - plan[0], actual)

    def overlength(self, pool: str, record: RequestRecord, counted: int) -> None:
        """The pool's replica counted `counted` prompt tokens when it refused the prompt as too long."""
        if counted and record.prompt_tokens_raw:
            self.ratio(pool, record.prompt_tokens_raw, counted, at_least=True)  # vLLM counted a truncated prompt

    def ratio(self, pool: str, estimated: int, counted: int, at_least: bool = False) -> None:
        """One count for the pool's token-estimate ratio; logged only when it moved materially, once a minute at
        most per pool (policies/estimates.py decides)."""
        if self.gw.estimates.observe(pool, estimated, counted, self.gw.clock(), at_least=at_least):
            log.warning("pool %s: its replicas count %.2f× the gateway's token estimate; pool choice now corrects "
                        "for it (set classification.calibration_factor to match)", pool, self.gw.estimates.ratio(pool))

    def finished(self, record: RequestRecord, replica: Replica | None) -> None:
        """A request ended; `replica`: the one that streamed it, when it did so to the end or broke it."""
        if record.status != 200:
            return
        if replica is not None:
            prompt, completion, cached = record.tokens()
            pd = record.pd
            replica.observe_latency(  # a P/D decode replica pulled its prompt: no prefill rate to learn
                0 if pd is not None and pd.prefilled else max(0, (prompt or record.prompt_tokens_est) - cached),
                record.t_first_byte - record.t_sent, completion, record.t_last_byte - record.t_first_byte,
            )
        if record.usage:
            self.learn_from_answer(record)

    def learn_from_answer(self, record: RequestRecord) -> None:
        """What one answer's usage teaches: the token ratio, the pool's TTFT calibration (a complete stream's first
        token, timed from the send), and the class's output length."""
        gw = self.gw
        prompt, completion, _ = record.tokens()
        if record.prompt_tokens_raw and prompt:
            self.ratio(record.pool, record.prompt_tokens_raw, prompt)
        decision = record.decision
        if (decision is not None and decision.features is not None and record.stream and record.t_first_byte
                and record.error is None and not record.client_disconnected and not record.retried):
            calibrator = gw.latency.get(record.pool)
            if calibrator is not None:
                calibrator.learn(decision.features, record.t_first_byte - record.t_sent)
        if completion and record.error is None and not record.client_disconnected:
            self.output_length(record, completion)

    def expected_output(self, record: RequestRecord, body: dict[str, Any], profile: RequestProfile, key: str,
                        session: str) -> int:
        """The request's output estimate (0 with estimates off), kept on the record with what it rested on;
        `session`: its session as admission scopes it ("" for none), `key`: its API key's id."""
        estimator = self.gw.output_estimates
        if estimator is None:
            return 0
        hints = output_hints(body, profile.thinking_mode, profile.output_budget)
        estimate = estimator.estimate(hints, self.gw.clock(), session, key, record.traffic_class)
        record.output_predicted, record.output_basis = estimate.tokens, OutputBasis(hints, session, key)
        return estimate.tokens

    def output_length(self, record: RequestRecord, completion: int) -> None:
        """A whole answer's output tokens, for the estimates of its session, key and class."""
        basis, estimator = record.output_basis, self.gw.output_estimates
        if isinstance(basis, OutputBasis) and estimator is not None:
            estimator.observe(basis.hints, completion, self.gw.clock(), basis.session, basis.key,
                              record.traffic_class)
