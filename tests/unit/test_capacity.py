"""policies/capacity.py: the sizing model on crafted pools (compute-bound scales with demand, a KV-bound pool is sized
by memory, queueing is counted, the gateway's backlog is demand), the signal's stability rules (up at once, down only
after the window and only when N−1 met the window's peak, bounds, the start-up lead from the arrival trend, the check
against measured latency), and the decode step cost
learnt from inter-token gaps (policies/latency_model.DecodeCost)."""

from __future__ import annotations

import math
import random

import pytest

from policies.capacity import (
    ClassDemand, EngineCosts, SizingParams, Stabilizer, Trend, arrival_trend, lead_factor, predict, rising, risk_factor,
    saturated_floor, scaled, size,
)
from policies.latency_model import DecodeCost

COSTS = EngineCosts(prefill_step_s=0.02, prefill_s_per_1k=0.06, decode_step_s=0.02, decode_s_per_seq=2e-4,
                    decode_s_per_seq_1k=2e-5, kv_tokens=None)


def chat(rate: float, ttft: float | None = 1.0, tpot: float | None = 0.05, **kw: float) -> ClassDemand:
    base = {"prompt_tokens": 4000.0, "uncached_tokens": 1500.0, "output_tokens": 400.0}
    base.update(kw)
    return ClassDemand("interactive", rate, ttft_p95_s=ttft, tpot_p95_s=tpot, **base)


def assert_minimal(role: str, demand: list[ClassDemand], costs: EngineCosts, n: int) -> None:
    assert predict(role, demand, costs, n).ok()
    assert n == 1 or not predict(role, demand, costs, n - 1).ok()


@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
def test_doubling_a_compute_bound_demand_roughly_doubles_the_replicas(role: str) -> None:
    small = size(role, [chat(40.0)], COSTS)
    large = size(role, [chat(80.0)], COSTS)
    assert small.replicas >= 4
    assert 1.6 <= large.replicas / small.replicas <= 2.4
    assert small.bottleneck in ("prefill_compute", "decode_compute")
    assert_minimal(role, [chat(80.0)], COSTS, large.replicas)


def test_a_long_context_pool_with_little_kv_is_sized_by_memory() -> None:
    costs = EngineCosts(**{**_fields(COSTS), "kv_tokens": 1500 * 128})  # ~190K tokens of KV per replica
    demand = [chat(0.5, ttft=30.0, tpot=0.2, prompt_tokens=100_000, uncached_tokens=2000, output_tokens=2000)]
    sizing = size("both", demand, costs)
    assert sizing.bottleneck == "kv_memory"
    assert sizing.prediction.kv_usage is not None and sizing.prediction.kv_usage <= 0.9
    below = predict("both", demand, costs, sizing.replicas - 1)
    assert below.kv_usage is not None and below.kv_usage > 0.9
    assert below.meets["prefill_compute"] and below.meets["decode_compute"]  # memory alone asked for the last one
    # the same demand with plenty of KV needs fewer
    roomy = size("both", demand, EngineCosts(**{**_fields(COSTS), "kv_tokens": 100 * 1500 * 128}))
    assert roomy.replicas < sizing.replicas


def test_queueing_counts_a_pool_busy_below_its_throughput_still_misses_a_tight_ttft() -> None:
    """Throughput alone (utilisation < 1) would take fewer replicas than the TTFT target needs once waits count."""
    demand = [chat(30.0, ttft=0.25, tpot=None)]
    sizing = size("prefill", demand, COSTS)
    per_request = COSTS.prefill_step_s + COSTS.prefill_s_per_1k * 1.5  # a + c · uncached
    by_throughput = math.ceil(30.0 * per_request)
    assert sizing.replicas > by_throughput
    at_throughput = predict("prefill", demand, COSTS, by_throughput)
    assert at_throughput.utilisation < 1.0 and at_throughput.classes["interactive"].ttft_p95_s > 0.25
    assert_minimal("prefill", demand, COSTS, sizing.replicas)


def test_roles_hold_only_their_own_targets() -> None:
    demand = [chat(10.0, ttft=0.3, tpot=0.5)]  # tight TTFT, loose TPOT
    prefill, decode = size("prefill", demand, COSTS), size("decode", demand, COSTS)
    assert prefill.bottleneck == "prefill_compute" and decode.bottleneck in ("decode_compute", "kv_memory")
    assert prefill.replicas > decode.replicas
    at = predict("decode", demand, COSTS, decode.replicas)
    assert at.classes["interactive"].ttft_p95_s == COSTS.decode_step_s  # the KV pull's one step; TTFT is prefill's


def test_every_class_must_meet_its_own_target() -> None:
    loose = [chat(10.0, ttft=5.0), ClassDemand("batch", 5.0, 2000, 2000, 100, ttft_p95_s=20.0)]
    tight = [chat(10.0, ttft=0.3), ClassDemand("batch", 5.0, 2000, 2000, 100, ttft_p95_s=20.0)]
    assert size("both", tight, COSTS).replicas > size("both", loose, COSTS).replicas
    assert_minimal("both", tight, COSTS, size("both", tight, COSTS).replicas)


def test_the_gateways_backlog_is_demand() -> None:
    calm = size("both", [chat(10.0)], COSTS)
    backlog = size("both", [chat(10.0, queued=600)], COSTS, SizingParams(backlog_clear_s=30.0))
    assert backlog.replicas > calm.replicas
    assert backlog.bottleneck == "gateway_queue"


def test_no_demand_needs_nothing_and_an_impossible_target_gets_the_ceiling() -> None:
    idle = size("both", [chat(0.0)], COSTS)
    assert idle.replicas == 0 and idle.bottleneck is None
    impossible = size("both", [chat(1.0, ttft=0.001)], COSTS, SizingParams(max_replicas=64))
    assert impossible.replicas == 64


def test_an_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError):
        size("encode", [chat(1.0)], COSTS)


# ------------------------------------------------------------------------------------------------------------------
# the signal over time


def test_up_at_once_down_only_after_the_window_and_to_the_windows_peak() -> None:
    s = Stabilizer(window_s=300.0)
    assert s.update(0.0, 2, 2) == 2
    assert s.update(10.0, 5, 5) == 5  # a target at risk: up at once
    for t in range(20, 300, 10):  # demand fell back, but not for a whole window
        assert s.update(float(t), 2, 2) == 5
    # a window after the rise, the rise itself (t=10) is still the window's peak; once it leaves, down
    assert s.update(305.0, 2, 2) == 5
    assert s.update(315.0, 2, 2) == 2
    assert s.changed_at == 315.0


def test_down_waits_for_n_minus_one_to_meet_the_recent_peak() -> None:
    s = Stabilizer(window_s=100.0)
    s.update(0.0, 4, 4)
    for t in range(10, 200, 10):
        # mostly 2 needed, but a burst inside each window still needed 4: no step down while it is in the window
        measured = 4 if t % 90 == 0 else 2
        s.update(float(t), measured, measured)
    assert s.desired == 4
    for t in range(200, 500, 10):
        s.update(float(t), 3 if t < 300 else 2, 3 if t < 300 else 2)
    assert s.desired == 2  # 3 within the window held it at 3 first, then 2 once the 3s left the window
    assert s.changed_at >= 300.0


def test_a_fall_within_the_tolerance_is_not_a_change() -> None:
    s = Stabilizer(window_s=60.0)
    s.update(0.0, 10, 10)
    for t in range(5, 200, 5):
        s.update(float(t), 9, 9)
    assert s.desired == 10 and s.changed_at == 0.0  # 10 → 9 is within 10 %: no change
    for t in range(200, 300, 5):
        s.update(float(t), 5, 5)
    assert s.desired == 5  # a real fall, in one step once the window is past
    s.update(300.0, 4, 4)
    assert s.desired == 5
    assert s.update(400.0, 4, 4) == 4  # small counts: one replica is more than 10 %


def test_no_fall_while_the_demand_rises() -> None:
    s = Stabilizer(window_s=60.0)
    s.update(0.0, 4, 4)
    for t in range(5, 120, 5):  # the window has passed and 2 would do, but the rate is rising: hold
        s.update(float(t), 2, 2, hold=rising(Trend(0.05, 0.03 ** 2)))
    assert s.desired == 4
    assert not rising(Trend(0.02, 0.03 ** 2)) and rising(Trend(0.05, 0.03 ** 2))
    assert s.update(125.0, 2, 2, hold=False) == 2


def test_constant_demand_never_changes_the_signal() -> None:
    s = Stabilizer(window_s=60.0)
    values = {s.update(float(t), 3, 3) for t in range(0, 3600, 5)}
    assert values == {3}


def test_bounds_hold_and_apply_when_they_change() -> None:
    s = Stabilizer(window_s=60.0)
    assert s.update(0.0, 0, 0, low=1) == 1
    assert s.update(5.0, 50, 50, low=1, high=8) == 8
    assert s.update(10.0, 50, 50, low=1, high=6) == 6  # a reload lowered the bound: applied at once
    assert s.update(15.0, 0, 0, low=2, high=6) == 6  # falling still waits for the window
    assert s.update(80.0, 0, 0, low=2, high=6) == 2


def test_a_short_answer_is_stalled_by_a_long_prefill_that_started_before_it_decodes() -> None:
    """A 24-token answer decodes for 0.36 s; 1.2 s chunked prefills arrive on its replica. One that starts up to
    1.2 s before it decodes still overlaps it, by less the earlier it started: the stall's p95 is the overlap only 5%
    of the streams exceed, D + S + ln(0.95)/λ, growing smoothly with the rate up to the whole prefill."""
    from policies.capacity import _tpot95_tail

    def stall(rate: float) -> float:
        return (_tpot95_tail(0.015, 0.015, 0.0, 0.0, 24.0, [(1.2, rate)]) - 0.015) * 23.0

    assert stall(0.06) == pytest.approx(0.36 + 1.2 + math.log(0.95) / 0.06, rel=1e-9)  # 0.71 s, in 9% of streams
    assert stall(0.02) == 0.0  # 3% of the streams overlap one at all: not the p95
    assert stall(0.5) == pytest.approx(1.2)  # one starts within every stream's own 0.36 s often enough: all of it
    rates = [0.03 + 0.001 * i for i in range(200)]
    stalls = [stall(r) for r in rates]
    assert stalls == sorted(stalls) and max(b - a for a, b in zip(stalls, stalls[1:])) < 0.1  # no jump


def _poisson(rng: random.Random, mean: float) -> int:
    n, t = 0, rng.expovariate(1.0)
    while t < mean:
        n += 1
        t += rng.expovariate(1.0)
    return n


def test_the_arrival_trend_is_the_rates_slope_through_the_windows_intervals() -> None:
    # exact counts of a rate rising 0.1 req/s each second, in 5 s intervals (one shorter: a late tick)
    bounds = [(0.0, 5.0), (5.0, 10.0), (10.0, 13.0), *((float(t), t + 5.0) for t in range(13, 58, 5))]
    exact = arrival_trend([(a, b, (10.0 + 0.05 * (a + b)) * (b - a)) for a, b in bounds])
    assert exact.slope == pytest.approx(0.1, rel=1e-9)
    assert arrival_trend([(0.0, 5.0, 3.0), (5.0, 10.0, 4.0)]) == Trend()  # too few intervals: no slope


def test_the_trends_error_is_calibrated_on_poisson_counts() -> None:
    """Under constant load, the slope over its standard error is a unit normal: the lead's two-error gate passes
    noise about one window in forty, whatever the rate."""
    rng = random.Random(7)
    for rate in (1.5, 30.0):
        z = []
        for _ in range(400):
            trend = arrival_trend([(t * 0.5, t * 0.5 + 0.5, float(_poisson(rng, rate * 0.5))) for t in range(40)])
            z.append(trend.slope / math.sqrt(trend.variance))
        mean = sum(z) / len(z)
        sd = math.sqrt(sum((v - mean) ** 2 for v in z) / len(z))
        assert abs(mean) < 0.2 and 0.8 < sd < 1.15, (rate, mean, sd)
        assert sum(1 for v in z if v > 2.0) / len(z) < 0.05


def test_a_rising_demand_is_led_by_the_start_up_time() -> None:
    rising = Trend(slope=0.1, variance=0.02 ** 2)  # +0.1 req/s each second, five standard errors
    factor = lead_factor(15.5, rising, horizon_s=120.0)
    assert factor == pytest.approx(1.0 + 0.1 * 120.0 / 15.5, rel=1e-9)
    assert lead_factor(15.5, Trend(0.1, 0.06 ** 2), 120.0) == 1.0  # under two standard errors: noise
    assert lead_factor(15.5, Trend(-0.1, 0.02 ** 2), 120.0) == 1.0  # a fall is not led
    assert lead_factor(15.5, Trend(), 120.0) == 1.0
    assert lead_factor(15.5, rising, horizon_s=1e6) == 3.0  # capped
    # led demand sizes higher than the demand measured now
    now = size("both", [chat(15.5)], COSTS).replicas
    ahead = size("both", [chat(15.5 * factor)], COSTS).replicas
    assert ahead > now


def test_a_missed_target_the_model_does_not_predict_scales_the_demand_until_it_does() -> None:
    demand = [chat(20.0, ttft=1.0, tpot=0.05)]
    n = size("both", demand, COSTS).replicas
    predicted = predict("both", demand, COSTS, n).classes["interactive"]
    assert predicted.ttft_p95_s <= 1.0
    # the targets met as measured, or a miss the model predicts already: the model holds
    assert risk_factor("both", demand, COSTS, n, {"interactive": (0.8, 0.04)}) == 1.0
    assert risk_factor("both", demand, COSTS, n, {"interactive": (None, None)}) == 1.0
    slow = predict("both", scaled(demand, 1.6), COSTS, n).classes["interactive"].ttft_p95_s
    assert slow > 1.0
    assert risk_factor("both", scaled(demand, 1.6), COSTS, n, {"interactive": (slow * 0.9, None)}) == 1.0
    # measured 1.2 s at n: the demand that gives 1.2 s in the model, and the count that meets the target for it
    factor = risk_factor("both", demand, COSTS, n, {"interactive": (1.2, None)})
    assert 1.3 < factor < 2.0
    at = predict("both", scaled(demand, factor), COSTS, n).classes["interactive"].ttft_p95_s
    assert at == pytest.approx(1.2, rel=0.05)
    assert size("both", scaled(demand, factor), COSTS).replicas > n
    # a TPOT miss counts for roles that decode only; a TTFT miss for roles that prefill only
    assert risk_factor("prefill", demand, COSTS, n, {"interactive": (None, 0.2)}) == 1.0
    assert risk_factor("decode", demand, COSTS, n, {"interactive": (5.0, None)}) == 1.0
    assert risk_factor("decode", demand, COSTS, n, {"interactive": (None, 0.2)}) > 1.0
    # failures (an infinite TTFT): at least the demand at which the model says n cannot keep up
    failing = risk_factor("both", demand, COSTS, n, {"interactive": (math.inf, None)}, cap=4.0)
    assert predict("both", scaled(demand, failing), COSTS, n).classes["interactive"].ttft_p95_s == math.inf
    assert predict("both", scaled(demand, failing - 0.02), COSTS, n).classes["interactive"].ttft_p95_s < math.inf


# ------------------------------------------------------------------------------------------------------------------
# the decode step cost


def test_decode_cost_learns_the_step_time_from_inter_token_gaps() -> None:
    rng = random.Random(3)
    truth = (0.012, 4e-4, 3e-5)
    cost = DecodeCost()
    for _ in range(3000):
        batch = rng.randint(1, 128)
        context = rng.uniform(500, 30_000)
        step = (truth[0] + batch * (truth[1] + truth[2] * context / 1000)) * math.exp(rng.gauss(0, 0.05))
        cost.learn(batch, context, step)
    for batch, context in ((1, 1000), (32, 8000), (128, 30_000)):
        true = truth[0] + batch * (truth[1] + truth[2] * context / 1000)
        assert cost.seconds(batch, context) == pytest.approx(true, rel=0.1)


def test_decode_cost_ignores_nonsense_and_survives_a_long_constant_batch() -> None:
    cost = DecodeCost()
    before = list(cost.coef)
    for bad in (0.0, -1.0, math.inf, math.nan):
        cost.learn(8, 1000, bad)
    assert cost.coef == before and cost.samples == 0
    for _ in range(5000):  # one batch size only: the uncertainty must not wind up
        cost.learn(16, 4000, 0.03)
    assert cost.seconds(16, 4000) == pytest.approx(0.03, rel=0.02)
    cost.learn(64, 4000, 0.06)
    assert 0.0 < cost.seconds(64, 4000) < 1.0


def _fields(costs: EngineCosts) -> dict[str, float | int | None]:
    return {name: getattr(costs, name) for name in EngineCosts.__slots__}


def test_a_prefill_pile_up_at_the_replicas_asks_for_more_before_any_answer_shows_it() -> None:
    demand = [chat(2.0, output_tokens=10.0)]
    calm = size("both", demand, COSTS)
    piled = size("both", demand, COSTS, prefill_backlog=24 * 8000)  # 24 long prompts sent, none prefilled yet
    assert piled.replicas > calm.replicas and piled.bottleneck == "prefill_compute"
    assert size("both", demand, COSTS, prefill_backlog=2000).replicas == calm.replicas  # a normal in-flight share


# one replica as an operator ran it: --max-num-seqs 4, 40 ms steps, 100-token answers (4 s each: ~1 request/s)
FOUR_SLOTS = EngineCosts(prefill_step_s=0.02, prefill_s_per_1k=0.06, decode_step_s=0.04, decode_s_per_seq=0.0,
                         decode_s_per_seq_1k=0.0, max_num_seqs=4)


def short_answers(rate: float, spread: float = 0.0) -> list[ClassDemand]:
    return [ClassDemand("interactive", rate, 30.0, 30.0, 100.0, ttft_p95_s=1.0, output_cv2=spread)]


def test_the_slot_limit_bounds_the_batch_a_full_replica_cannot_keep_up() -> None:
    blind = EngineCosts(**{**_fields(FOUR_SLOTS), "max_num_seqs": None})
    # 1.75 requests/s hold 7 sequences of a replica that runs 4: its queue grows without bound
    full = predict("both", short_answers(1.75), FOUR_SLOTS, 1)
    assert math.isinf(full.classes["interactive"].ttft_p95_s) and full.utilisation > 1.0 and not full.ok()
    sized = size("both", short_answers(1.75), FOUR_SLOTS)
    assert sized.replicas >= 2 and sized.bottleneck == "batch_slots"
    assert_minimal("both", short_answers(1.75), FOUR_SLOTS, sized.replicas)
    # the compute model alone sees a nearly idle replica (what the signal said: utilisation 0.16, TTFT 0.05 s)
    assert size("both", short_answers(1.75), blind).replicas == 1
    assert predict("both", short_answers(1.75), blind, 1).utilisation < 0.2
    # 0.4× the replica's rate: 1.6 slots busy, equal answers rarely wait
    assert size("both", short_answers(0.4), FOUR_SLOTS).replicas == 1
    # the batch at its 95th percentile never exceeds the slots: the TPOT tail is the step of a full batch at most
    # (a mean batch of 2.2 sequences is 4.7 at its p95 unbounded)
    per_seq = EngineCosts(**{**_fields(FOUR_SLOTS), "decode_s_per_seq": 0.002, "prefill_s_per_1k": 0.0})
    assert predict("both", short_answers(0.5), per_seq, 1).classes["interactive"].tpot_p95_s \
        == pytest.approx(0.04 + 4 * 0.002)


def test_answers_of_unequal_length_wait_longer_for_a_slot() -> None:
    equal = predict("both", short_answers(0.6, spread=0.0), FOUR_SLOTS, 1).classes["interactive"].ttft_p95_s
    exponential = predict("both", short_answers(0.6, spread=1.0), FOUR_SLOTS, 1).classes["interactive"].ttft_p95_s
    assert 0.0 < equal < exponential
    assert size("both", short_answers(0.6, spread=4.0), FOUR_SLOTS).replicas \
        >= size("both", short_answers(0.6, spread=0.0), FOUR_SLOTS).replicas


def test_a_saturated_pool_needs_at_least_one_more_and_what_carries_the_arrivals() -> None:
    # one replica completing 1 request/s while 1.75/s arrive: 2 carry it below 90 % busy
    assert saturated_floor(1, 1.75, 1.0) == 2
    assert saturated_floor(2, 6.0, 2.0) == 7  # 3 req/s a replica, 6/s arrive: ceil(2 × 3 / 0.9)
    assert saturated_floor(3, 1.0, 1.0) == 4  # a standing queue at the rate it completes: one more at least
    assert saturated_floor(1, 2.0, 0.0) == 2 and saturated_floor(0, 2.0, 0.0) == 1
