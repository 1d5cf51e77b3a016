"""policies/capacity.py: the sizing model on crafted pools (compute-bound scales with demand, a KV-bound pool is sized
by memory, queueing is counted, the gateway's backlog is demand), the signal's stability rules (up at once, down only
after the window and only when N−1 met the window's peak, bounds, the start-up lead), and the decode step cost
learnt from inter-token gaps (policies/latency_model.DecodeCost)."""

from __future__ import annotations

import math
import random

import pytest

from policies.capacity import (ClassDemand, EngineCosts, SizingParams, Stabilizer, lead_factor, predict, size)
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


def test_a_rising_demand_is_led_by_the_start_up_time() -> None:
    rising = [(float(t), 10.0 + t * 0.1) for t in range(0, 60, 5)]  # +0.1 req/s each second
    factor = lead_factor(rising, horizon_s=120.0)
    level = 10.0 + 55 * 0.1
    assert factor == pytest.approx(1.0 + 0.1 * 120.0 / level, rel=1e-6)
    assert lead_factor([(float(t), 10.0) for t in range(0, 60, 5)], 120.0) == 1.0
    assert lead_factor([(float(t), 20.0 - t * 0.1) for t in range(0, 60, 5)], 120.0) == 1.0
    assert lead_factor(rising, horizon_s=1e6) == 2.0  # capped
    # led demand sizes higher than the demand measured now
    now = size("both", [chat(level)], COSTS).replicas
    ahead = size("both", [chat(level * factor)], COSTS).replicas
    assert ahead > now


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
