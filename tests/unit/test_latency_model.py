"""policies/latency_model.py and the SLO-aware choice it enables in PrefixAffinity: the calibration converges to the
truth of a synthetic replica (median and P90), starts as the analytic model, and a replica predicted to miss an
objective yields to one predicted to meet it, but only then."""

from __future__ import annotations

import math
import random

import pytest

from policies.latency_model import PrefillCost, TtftCalibrator, prefill_plan, ttft_features
from policies.replica_choice import PrefixAffinity, ReplicaSnapshot, RoutingRequest
from policies.traffic import request_slos
from policies.config import TrafficConfig
from policies.errors import RequestRejected
from pools.replicas import Replica


def test_a_fresh_calibrator_is_the_analytic_model() -> None:
    cal = TtftCalibrator()
    x = ttft_features(0.4, 3000, 2, 4, 0.3)
    median, p90 = cal.predict(x)
    assert median == pytest.approx(0.4, rel=1e-6)
    assert p90 == pytest.approx(1.5 * 0.4 + 1e-3, rel=1e-2)


class _Engine:
    """A synthetic replica as vLLM schedules prefill: requests waiting when a step starts share it, a step costs
    a + c · tokens, times noisy (log-normal)."""

    def __init__(self, rng: random.Random, a: float, c_per_1k: float, noise: float) -> None:
        self.rng, self.a, self.c, self.noise = rng, a, c_per_1k, noise
        self.start = self.end = 0.0
        self.tokens = 0

    def send(self, now: float, uncached: int) -> float:
        """The request's true TTFT."""
        if now >= self.end:
            self.start, self.tokens = now, uncached
        elif now < self.start:
            self.tokens += uncached
        else:
            self.start, self.tokens = self.end, uncached
        self.end = self.start + (self.a + self.c * self.tokens / 1000) * math.exp(self.rng.gauss(0, self.noise))
        return self.end - now


def _replay(cal: TtftCalibrator, engine: _Engine, rng: random.Random, n: int, rate: float,
            slow_after: int | None = None) -> tuple[list[float], list[bool]]:
    """Send n requests (Poisson at `rate`/s) through the gateway's own model and the engine, predicting each before
    learning from it as the gateway does; the replica's clock follows the plans as `Replica.plan_step` does. Returns
    the absolute percentage errors of the median and whether each TTFT was at or under its P90."""
    replica = Replica(url="http://a", pool="p")
    now, errors, covered = 0.0, [], []
    pending: list[tuple[float, int]] = []  # (first token at, uncached) of requests before their first token
    for i in range(n):
        if slow_after is not None and i == slow_after:
            engine.a, engine.c = engine.a * 3, engine.c * 3
        now += rng.expovariate(rate)
        for done in [p for p in pending if p[0] <= now]:
            pending.remove(done)
            replica.prefill_tokens -= done[1]
        uncached = rng.randint(100, 3000)
        snap = replica.snapshot(now)
        plan = prefill_plan(cal.cost, snap.step_starts_in, snap.step_ends_in, snap.step_tokens, uncached,
                            snap.prefill_tokens)
        x = ttft_features(plan[2], uncached, 0, 0, 0.0)
        median, p90 = cal.predict(x)
        replica.plan_step(now, plan)
        replica.prefill_tokens += uncached
        actual = engine.send(now, uncached)
        pending.append((now + actual, uncached))
        errors.append(abs(actual - median) / actual)
        covered.append(actual <= p90)
        cal.learn(x, actual)
        cal.learn_cost(plan[1], actual - plan[0], actual)
    return errors, covered


@pytest.mark.parametrize("load", [0.3, 0.7, 0.95])
def test_the_step_clock_and_learnt_cost_predict_a_batching_engine(load: float) -> None:
    """An engine 3× slower per token than the routing default and with a 40 ms step, at 30/70/95% of its prefill
    capacity: the pool's cost model finds a and c, and the step clock's TTFT is within the noise of the truth."""
    rng = random.Random(7)
    a, c = 0.04, 0.18  # 40 ms a step, 180 µs a token
    capacity = 1.0 / (a + c * 1.55)  # requests/s when each has its own step (1,550 tokens on average)
    cal = TtftCalibrator()
    errors, covered = _replay(cal, _Engine(rng, a, c, noise=0.1), rng, 3000, load * capacity)
    assert cal.cost.a == pytest.approx(a, rel=0.3) and cal.cost.c == pytest.approx(c, rel=0.1)
    warm = errors[500:]
    assert sum(warm) / len(warm) < 0.2, sum(warm) / len(warm)
    share = sum(covered[500:]) / len(covered[500:])
    assert 0.85 <= share <= 0.97, share


def test_the_step_clock_joins_waits_and_caps() -> None:
    cost = PrefillCost(a=0.02, c_per_1k=0.1)
    # idle: a step of its own, now
    assert prefill_plan(cost, -1.0, -0.5, 900, 1000, 0) == (0.0, 1000, pytest.approx(0.12))
    # idle by the clock, but 4,000 tokens sent have not reached their first token: the engine is behind the clock
    offset, tokens, ttft = prefill_plan(cost, -1.0, -0.5, 900, 1000, 4000)
    assert (offset, tokens, ttft) == (pytest.approx(0.21), 1000, pytest.approx(0.33))
    # the next step has not started: join it (its 2,000 tokens and ours in one step)
    assert prefill_plan(cost, 0.3, 0.6, 2000, 1000, 9000) == (0.3, 3000, pytest.approx(0.3 + 0.32))
    # a step runs: the next one, after it
    assert prefill_plan(cost, -0.1, 0.1, 2000, 1000, 2000) == (0.1, 1000, pytest.approx(0.22))
    # a clock that runs fast (it says the step ends in 10 ms, with 100K tokens queued ahead) is held back to a
    # quarter of the queued work plus our own step
    offset, tokens, ttft = prefill_plan(cost, -0.5, 0.01, 1000, 1000, 100_000)
    assert ttft == pytest.approx(0.25 * 10.0 + 0.12) and offset == pytest.approx(ttft - 0.12)
    # a clock far ahead of what is queued (an overestimate) is capped: all queued + ours, in two steps at most
    offset, tokens, ttft = prefill_plan(cost, 5.0, 9.0, 2000, 1000, 1000)
    assert ttft == pytest.approx(0.02 + 0.2 + 0.02) and offset <= ttft


def test_the_cost_model_ignores_nonsense_and_starts_at_the_routing_defaults() -> None:
    cost = PrefillCost()
    assert cost.seconds(1000) == pytest.approx(0.02 + 0.06)
    for bad in ((1000, float("nan"), 0.1), (1000, 0.1, float("inf")), (1000, -0.1, 0.1), (1000, 0.1, 0.0)):
        cost.learn(*bad)
    assert cost.samples == 0


def test_nonsense_samples_are_ignored() -> None:
    cal = TtftCalibrator()
    x = ttft_features(0.4, 3000, 2, 4, 0.3)
    for bad in (float("nan"), float("inf"), -1.0):
        cal.learn(x, bad)
    assert cal.samples == 0


def _replica(url: str, waiting: float, prefill: float = 60e-6, tpot: float = 0.02) -> ReplicaSnapshot:
    return ReplicaSnapshot(url=url, pool="p", waiting=waiting, running=2.0, kv_usage=0.3, metrics_age_s=0.1,
                           prefill_s_per_token=prefill, tpot_s=tpot)


class _Matcher:
    def __init__(self, blocks: dict[str, int]) -> None:
        self.blocks = blocks

    def match_all(self, hashes: object) -> dict[str, int]:
        return self.blocks

    def record(self, replica: str, hashes: object, now: float) -> None:
        return None


def test_the_affine_replica_keeps_a_request_it_is_predicted_to_serve_in_time() -> None:
    policy = PrefixAffinity(_Matcher({"http://a": 60}), calibrator=TtftCalibrator())
    replicas = [_replica("http://a", 0), _replica("http://b", 0)]
    request = RoutingRequest(prompt_tokens=8000, output_budget=256, block_hashes=tuple(range(62)), ttft_slo_s=5.0)
    decision = policy.choose(request, replicas, 0.0)
    assert decision.replica == "http://a" and decision.reason.startswith("affinity_hit")
    assert decision.slo_met is True and decision.predicted_ttft_p90_s is not None
    assert decision.features is not None and decision.runner_up_ttft_s is not None


def test_a_sticky_replica_predicted_to_miss_yields_to_one_that_meets_it() -> None:
    """A session stays on its replica while its TTFT is within 1.5× the best; an objective between the two
    replicas' P90s moves it."""
    policy = PrefixAffinity(_Matcher({}), calibrator=TtftCalibrator())
    replicas = [_replica("http://a", 0.4), _replica("http://b", 0)]
    plain = RoutingRequest(prompt_tokens=8000, output_budget=256, block_hashes=(1,), session_key="s")
    policy.dispatched(plain, "http://a", 0.0)
    kept = policy.choose(plain, replicas, 1.0)
    assert kept.replica == "http://a" and kept.reason == "session"
    p90_a = kept.predicted_ttft_p90_s or 0.0
    p90_b = 2.0 * (kept.runner_up_ttft_s or 0.0)
    assert p90_b < p90_a
    slo = (p90_a + p90_b) / 2
    moved = policy.choose(RoutingRequest(prompt_tokens=8000, output_budget=256, block_hashes=(1,), session_key="s",
                                         ttft_slo_s=slo), replicas, 1.0)
    assert moved.replica == "http://b" and moved.reason == "slo_move" and moved.slo_met is True
    assert (moved.predicted_ttft_p90_s or 0.0) <= slo
    met = policy.choose(RoutingRequest(prompt_tokens=8000, output_budget=256, block_hashes=(1,), session_key="s",
                                       ttft_slo_s=p90_a * 2), replicas, 1.0)
    assert met.replica == "http://a" and met.reason == "session" and met.slo_met is True
    stuck = policy.choose(RoutingRequest(prompt_tokens=8000, output_budget=256, block_hashes=(1,), session_key="s",
                                         ttft_slo_s=1e-6), replicas, 1.0)
    assert stuck.slo_met is False and stuck.reason == "session"


def test_a_tpot_objective_moves_off_a_slow_decoder() -> None:
    policy = PrefixAffinity(_Matcher({"http://a": 60}), calibrator=TtftCalibrator())
    replicas = [_replica("http://a", 0, tpot=0.2), _replica("http://b", 0, tpot=0.02)]
    request = RoutingRequest(prompt_tokens=8000, output_budget=256, block_hashes=tuple(range(62)), tpot_slo_s=0.05)
    decision = policy.choose(request, replicas, 0.0)
    assert decision.replica == "http://b" and decision.reason == "slo_move"


def test_slo_headers_and_class_targets() -> None:
    traffic = TrafficConfig()
    assert request_slos(None, None, traffic, "interactive", slo_aware=False) == (None, None)
    assert request_slos(None, None, traffic, "interactive", slo_aware=True) == (1.0, None)
    assert request_slos("800", "50", traffic, "interactive", slo_aware=False) == (0.8, 0.05)
    for bad in ("-5", "soon", "0", "nan"):
        with pytest.raises(RequestRejected) as err:
            request_slos(bad, None, traffic, "interactive", slo_aware=False)
        assert err.value.status == 400 and err.value.param == "x-slo-ttft-ms"


def test_prefill_work_ahead_is_counted_from_send_to_first_token() -> None:
    """The gateway's exact view of a replica's prefill queue: uncached tokens sent, not yet at their first token."""
    replica = Replica(url="http://a", pool="p")
    first, second = replica.guard(9000, prefill_tokens=6000), replica.guard(3000, prefill_tokens=2000)
    assert replica.prefill_tokens == 8000 and replica.snapshot(0.0).prefill_tokens == 8000
    first.first_token()
    first.first_token()  # idempotent
    assert replica.prefill_tokens == 2000
    first.release()
    assert replica.prefill_tokens == 2000 and replica.in_flight == 1
    second.release()  # ended before its first token (failed, client gone): its prefill leaves the queue too
    second.release()
    assert (replica.prefill_tokens, replica.in_flight, replica.in_flight_tokens) == (0, 0, 0)


def test_the_calibrated_median_sees_the_steps_this_gateway_planned() -> None:
    """Two replicas the scrapes call equal: the one whose planned prefill step (this gateway
    sent, 30K queued in all) runs for another 1.5 s is predicted slower, fresh as the model is."""
    policy = PrefixAffinity(_Matcher({}), calibrator=TtftCalibrator())
    replicas = [_replica("http://a", 0), _replica("http://b", 0)]
    replicas[0].prefill_tokens, replicas[0].step_starts_in, replicas[0].step_ends_in = 30_000, -0.1, 1.5
    request = RoutingRequest(prompt_tokens=2000, output_budget=64, block_hashes=(1,), ttft_slo_s=1.0)
    decision = policy.choose(request, replicas, 0.0)
    assert decision.replica == "http://b"
    assert decision.predicted_ttft_s == pytest.approx(0.02 + 2000 * 60e-6, rel=0.01)
    assert decision.runner_up_ttft_s == pytest.approx(1.5 + 0.02 + 2000 * 60e-6, rel=0.01)
    assert decision.prefill_plan == (0.0, 2000, pytest.approx(0.14))


def test_the_model_follows_an_engine_that_slows_down() -> None:
    """Online, predicting each request before learning from it: the engine becomes 3× slower halfway (a replica
    restarted on slower hardware, a co-tenant); the cost model follows it and the P90 keeps its coverage."""
    rng = random.Random(3)
    cal = TtftCalibrator()
    errors, covered = _replay(cal, _Engine(rng, 0.03, 0.12, noise=0.2), rng, 3200, 0.8, slow_after=1200)
    after = slice(2000, None)
    assert sum(errors[after]) / len(errors[after]) < 0.3
    assert 0.85 <= sum(covered[after]) / len(covered[after]) <= 0.97, sum(covered[after]) / len(covered[after])
