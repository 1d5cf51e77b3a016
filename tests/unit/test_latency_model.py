"""policies/latency_model.py and the SLO-aware choice it enables in PrefixAffinity: the calibration converges to the
truth of a synthetic replica (median and P90), starts as the analytic model, and a replica predicted to miss an
objective yields to one predicted to meet it, but only then."""

from __future__ import annotations

import math
import random

import pytest

from policies.latency_model import OutputLengths, TtftCalibrator, ttft_features
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
    assert p90 == pytest.approx(2.0 * 0.4 + 1e-3, rel=1e-2)


def test_it_learns_a_biased_noisy_truth_to_its_median_and_p90() -> None:
    """Truth: 2.5× the analytic figure plus a queue effect the analytic model misses, with log-normal noise."""
    rng = random.Random(1)
    cal = TtftCalibrator()

    def draw() -> tuple[tuple[float, ...], float]:
        analytic = rng.uniform(0.05, 2.0)
        waiting = rng.randint(0, 12)
        x = ttft_features(analytic, rng.randint(100, 16000), waiting, rng.randint(0, 16), rng.random())
        return x, 2.5 * analytic * (1 + 0.1 * waiting) * math.exp(rng.gauss(0, 0.25))

    for _ in range(6000):
        cal.learn(*draw())
    errors, covered = [], 0
    for _ in range(2000):
        x, actual = draw()
        median, p90 = cal.predict(x)
        errors.append(abs(actual - median) / actual)
        covered += actual <= p90
    mape = sum(errors) / len(errors)
    assert mape < 0.25, mape  # the noise alone gives ~0.2
    assert 0.85 <= covered / 2000 <= 0.95, covered / 2000


def test_nonsense_samples_are_ignored() -> None:
    cal = TtftCalibrator()
    x = ttft_features(0.4, 3000, 2, 4, 0.3)
    for bad in (float("nan"), float("inf"), -1.0):
        cal.learn(x, bad)
    assert cal.samples == 0


def test_output_lengths_per_class_and_thinking_mode() -> None:
    lengths = OutputLengths(alpha=0.5)
    assert lengths.predict("interactive", "enabled", 4096) == 4096  # nothing known: the budget
    for tokens in (1000, 1200, 1100):
        lengths.observe("interactive", "enabled", tokens)
    lengths.observe("interactive", "disabled", 80)
    assert 1000 <= lengths.predict("interactive", "enabled", 4096) <= 1200
    assert lengths.predict("interactive", "disabled", 4096) == 80
    assert lengths.predict("interactive", "enabled", 500) == 500  # never above the budget


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


def test_the_calibrated_features_see_the_prefill_this_gateway_queued() -> None:
    """Two replicas the scrapes call equal: the one this gateway sent 24K uncached tokens that are still prefilling
    is predicted slower by the calibrated model (its analytic input is the work ahead), fresh as it is."""
    policy = PrefixAffinity(_Matcher({}), calibrator=TtftCalibrator())
    replicas = [_replica("http://a", 0), _replica("http://b", 0)]
    replicas[0].prefill_tokens = 24_000
    request = RoutingRequest(prompt_tokens=2000, output_budget=64, block_hashes=(1,), ttft_slo_s=1.0)
    decision = policy.choose(request, replicas, 0.0)
    assert decision.replica == "http://b"
    assert decision.predicted_ttft_s == pytest.approx(2000 * 60e-6 + 0.02, rel=0.05)
    assert decision.runner_up_ttft_s == pytest.approx(26_000 * 60e-6 + 0.02, rel=0.05)


def test_the_p90_keeps_its_coverage_through_a_load_shift() -> None:
    """Online, predicting each request before learning from it: the load triples halfway; the P90 (the regression
    with the residual-spread floor) still covers about 90% of what follows, the median re-centres."""
    rng = random.Random(3)
    cal = TtftCalibrator()
    covered, ratios = [], []
    for n in range(1600):
        analytic = rng.uniform(0.05, 2.0)
        x = ttft_features(analytic, rng.randint(100, 16000), rng.randint(0, 12), rng.randint(0, 16), rng.random())
        actual = (1.0 if n < 800 else 3.0) * analytic * math.exp(rng.gauss(0, 0.3))
        median, p90 = cal.predict(x)
        if n >= 900:
            covered.append(actual <= p90)
            ratios.append(actual / median)
        cal.learn(x, actual)
    assert 0.85 <= sum(covered) / len(covered) <= 0.97, sum(covered) / len(covered)
    assert 0.8 <= sorted(ratios)[len(ratios) // 2] <= 1.25
