"""loadtests/lib/autoscale.py's models of the peers' autoscalers and bench_autoscale's verdicts: the HPA's behaviour
(scale-up per period, scale-down to the window's highest recommendation), llm-d's saturation step, the day's
phases, and how the targets are judged."""

from __future__ import annotations

from loadtests.lib.autoscale import DAY, Day, Hpa, Timescale, saturation_step
from loadtests.bench.autoscale import constant_changes, verdicts


def test_the_hpa_rises_within_its_scale_up_policy_and_falls_to_the_window_peak() -> None:
    hpa = Hpa(down_window_s=30.0, up_period_s=15.0, up_percent=100.0, up_pods=4)
    assert hpa.apply(0.0, 2, 20, 1, 50) == 6  # max(100 % of 2, 4 pods) more
    assert hpa.apply(5.0, 6, 20, 1, 50) == 6  # same period: the limit counts from its start
    assert hpa.apply(16.0, 6, 20, 1, 50) == 12  # next period: double again
    assert hpa.apply(20.0, 12, 3, 1, 50) == 12  # a drop waits: 20 was recommended within the window
    assert hpa.apply(47.0, 12, 3, 1, 50) == 3  # the window holds only 3s now
    assert hpa.apply(48.0, 3, 100, 1, 8) == 7  # bounded by max... and by the per-period limit
    only_double = Hpa(down_window_s=60.0, up_period_s=60.0, up_percent=100.0, up_pods=0)
    assert only_double.apply(0.0, 3, 10, 1, 50) == 6


def test_the_saturation_rule_steps_by_one() -> None:
    kv, q, kv_spare, q_spare = 0.8, 5.0, 0.1, 3.0
    assert saturation_step([(0.2, 0.0), (0.3, 1.0)], kv, q, kv_spare, q_spare) == -1  # N−1 still has spare
    assert saturation_step([(0.2, 3.0), (0.3, 4.0)], kv, q, kv_spare, q_spare) == 1  # average spare queue 1.5 < 3
    assert saturation_step([(0.75, 0.0), (0.75, 0.0)], kv, q, kv_spare, q_spare) == 1  # spare KV 0.05 < 0.1
    assert saturation_step([(0.9, 9.0), (0.95, 7.0)], kv, q, kv_spare, q_spare) == 1  # every replica saturated
    assert saturation_step([(0.4, 1.0), (0.45, 1.0)], kv, q, kv_spare, q_spare) == 0  # N−1 would hold 0.85 KV
    assert saturation_step([(0.1, 0.0)], kv, q, kv_spare, q_spare) == 0  # never below one


def test_the_day_is_24_hours_of_phases_with_constant_ones() -> None:
    day = Day(DAY, Timescale(hour_s=10.0))
    assert day.duration_s == 240.0
    assert [p.name for p, _, _ in day.bounds() if p.constant] == ["night", "afternoon"]
    items = day.items()
    night_rate = sum(1 for i in items["interactive"] if i.at < 70.0) / 70.0
    peak = [b for b in day.bounds() if b[0].name == "afternoon"][0]
    peak_rate = sum(1 for i in items["interactive"] if peak[1] <= i.at < peak[2]) / (peak[2] - peak[1])
    assert 2.5 < peak_rate / night_rate < 6.0  # ×4, Poisson noise allowed
    assert items == Day(DAY, Timescale(hour_s=10.0)).items()  # seeded: every policy gets the same requests


def test_constant_load_changes_count_the_busiest_ten_minutes_of_a_constant_phase() -> None:
    day = Day(DAY, Timescale(hour_s=10.0, control=0.1))  # night 0-70 s, ten minutes = 60 s
    events = [(5.0, 1, 2), (40.0, 2, 1), (50.0, 1, 2), (75.0, 2, 3)]  # the last is in the ramp
    assert constant_changes(events, day, 60.0) == 3
    assert constant_changes([(5.0, 1, 2), (68.0, 2, 1)], day, 60.0) == 1


def _policy(att_i: float, att_r: float, overall: float, rs: float, changes: int = 0) -> dict:  # type: ignore[type-arg]
    return {"classes": {"interactive": {"attainment_pct": att_i}, "repository": {"attainment_pct": att_r}},
            "attainment_pct": overall, "replica_seconds": rs, "constant_load_changes": changes}


def test_the_verdicts_follow_the_issue_s_targets() -> None:
    s = {"m3gate": _policy(95.0, 99.0, 96.0, 550.0, 1), "fixed": _policy(96.0, 100.0, 97.0, 1000.0),
         "keda": _policy(80.0, 90.0, 82.0, 500.0), "llm-d": _policy(95.0, 99.0, 96.5, 700.0)}
    v = verdicts(s)
    assert v["vs fixed"]["pass"]  # within 2 points each, 55 %
    assert not v["vs keda"]["pass"]  # +14 points but more replica-seconds
    assert v["vs llm-d"]["pass"]  # the same attainment at 79 %
    assert v["constant load"]["pass"]
    s["m3gate"] = _policy(93.0, 99.0, 96.0, 550.0, 2)
    v = verdicts(s)
    assert not v["vs fixed"]["pass"] and not v["constant load"]["pass"]
