"""The placement rule's parts: a window that tells persistent overload from a burst, and the move's cost test."""

from __future__ import annotations

import math

import pytest

from policies.placement import DispatchRate, QueueWindow, move_cost_s, should_move


def test_a_first_sight_is_its_own_average() -> None:
    window = QueueWindow(3.0)
    assert window.observe("a", 2.0, now=10.0) == 2.0
    assert window.average("a") == 2.0
    assert window.average("b") is None


def test_the_average_follows_a_persistent_value_and_barely_moves_for_a_burst() -> None:
    window = QueueWindow(3.0)
    window.observe("a", 0.0, now=0.0)
    wait = window.observe("a", 10.0, now=0.05)  # a burst, 50 ms after a calm sight
    assert wait == pytest.approx(10.0 * (1 - math.exp(-0.05 / 3.0)))
    assert wait < 0.2
    for t in range(1, 20):  # the same wait, seen every second for 19 s
        wait = window.observe("a", 10.0, now=0.05 + t)
    assert wait == pytest.approx(10.0, rel=0.01)


def test_no_time_elapsed_leaves_the_average() -> None:
    window = QueueWindow(3.0)
    window.observe("a", 1.0, now=5.0)
    assert window.observe("a", 9.0, now=5.0) == 1.0


def test_the_window_is_bounded_and_forgets() -> None:
    window = QueueWindow(3.0, max_replicas=3)
    for k in range(5):
        window.observe(f"r{k}", 1.0, now=float(k))
    assert len(window) == 3 and window.average("r0") is None and window.average("r4") is not None
    window.forget("r4")
    assert window.average("r4") is None
    with pytest.raises(ValueError):
        QueueWindow(0.0)


def test_a_move_must_save_its_prefill_and_the_displaced_share_now_and_over_the_window() -> None:
    extra = 0.8  # the target recomputes 0.8 s of prefix
    assert move_cost_s(extra, 0.25) == pytest.approx(0.2)
    threshold = extra + move_cost_s(extra, 0.25)  # 1.0 s
    assert should_move((threshold + 0.1, threshold + 0.1), (0.0, 0.0), extra, 0.25)
    assert not should_move((threshold - 0.1, threshold + 0.5), (0.0, 0.0), extra, 0.25)  # not now
    assert not should_move((threshold + 0.5, threshold - 0.1), (0.0, 0.0), extra, 0.25)  # a burst: not persistent
    assert not should_move((5.0, 5.0), (4.5, 4.5), extra, 0.25)  # the target is as queued
    assert not should_move((100.0, 100.0), (0.0, 0.0), extra, math.inf)  # never moves


def test_a_target_that_holds_as_much_costs_nothing_beyond_its_queue() -> None:
    assert should_move((0.3, 0.3), (0.1, 0.1), 0.0, 1.0)
    assert not should_move((0.1, 0.1), (0.1, 0.1), 0.0, 1.0)


def test_the_dispatch_rate_is_requests_per_second_over_its_window() -> None:
    sends = DispatchRate(window_s=30.0)
    for k in range(300):  # 2 requests/s for 150 s
        sends.sent("a", now=k * 0.5)
    assert sends.rate("a", now=150.0) == pytest.approx(2.0, rel=0.05)
    assert sends.rate("a", now=180.0) == pytest.approx(2.0 * math.exp(-1.0), rel=0.05)  # fades after
    assert sends.rate("never", now=0.0) == 0.0


def test_a_new_prefix_finds_room_on_the_replicas_sent_least_lately() -> None:
    sends = DispatchRate(window_s=30.0)
    for k in range(60):
        sends.sent("busy", now=float(k))
        if k % 2:
            sends.sent("half", now=float(k))
    sends.sent("calm", now=59.0)
    assert sends.least_used(["busy", "half", "calm", "unseen"], now=60.0) == ["calm", "unseen"]
    assert sends.least_used(["busy", "half"], now=60.0) == ["half"]


def test_the_groups_later_requests_share_the_moves_cost() -> None:
    extra = 0.8  # threshold 1.0 s for one request
    assert not should_move((0.5, 0.5), (0.0, 0.0), extra, 0.25)
    assert should_move((0.5, 0.5), (0.0, 0.0), extra, 0.25, later_requests=3.0)  # 1.0 / 4 = 0.25 s
    assert not should_move((0.5, 0.5), (0.0, 0.0), extra, math.inf, later_requests=100.0)


def test_requests_that_wait_behind_the_extra_prefill_add_to_the_moves_cost() -> None:
    """Near saturation the target's backlog lasts, so the requests it is sent meanwhile each wait for the move's
    recompute: a gap that pays for the recompute alone does not pay for it three times over."""
    extra = 0.8  # threshold 1.0 s for one request, nobody behind
    assert should_move((1.2, 1.2), (0.0, 0.0), extra, 0.25)
    assert not should_move((1.2, 1.2), (0.0, 0.0), extra, 0.25, delayed_requests=2.0)  # 0.8 × 3 + 0.2 = 2.6 s
    assert should_move((2.7, 2.7), (0.0, 0.0), extra, 0.25, delayed_requests=2.0)
    # a hot group's later requests still share it: 2.6 s over 16 requests
    assert should_move((1.2, 1.2), (0.0, 0.0), extra, 0.25, later_requests=15.0, delayed_requests=2.0)
