"""The probing schedule (policies/probing.py): an idle replica backs off to 16× the interval and snaps back on a
dispatch; a busy, unhealthy or draining one stays at the interval; a failure brings the next visit (with its
/health) forward, at most once per interval. Every visit probes /health (pools/monitor.py)."""

from __future__ import annotations

import pytest

from policies.probing import MAX_BACKOFF, ProbeState, ProbingPolicy, Visit

INTERVAL = 2.0


def _idle(dispatches: int = 0, **kw: object) -> Visit:
    fields: dict[str, object] = {"healthy": True, "shutting_down": False, "in_flight": 0, "dispatches": dispatches,
                                 "engine_load": 0.0, "scraped": True, **kw}
    return Visit(**fields)  # type: ignore[arg-type]


def _visit(policy: ProbingPolicy, state: ProbeState, seen: Visit, health_ok: bool = True) -> None:
    """One visit at its due time as the monitor makes it: /health, then the scrape."""
    now = state.next_at
    policy.health_answered(state, health_ok)
    policy.visited(state, now, seen)


def test_an_idle_replica_backs_off_to_the_cap_and_its_gaps_double() -> None:
    policy = ProbingPolicy(INTERVAL)
    state = policy.new(0.0, phase=0.3)
    assert state.next_at == 0.0
    times = []
    for _ in range(12):
        times.append(state.next_at)
        _visit(policy, state, _idle())
    gaps = [b - a for a, b in zip(times, times[1:])]
    cap = INTERVAL * MAX_BACKOFF
    assert all(INTERVAL <= gap <= cap + INTERVAL for gap in gaps)  # each onto its grid: ≤ 34 s
    assert gaps[-4:] == pytest.approx([cap] * 4)  # then exactly the cap: 32 s
    assert state.period_s == cap and policy.backed_off(state)
    assert sum(gaps[:4]) < 2 * cap  # reached within a minute


def test_phases_spread_a_fleets_backed_off_visits() -> None:
    policy = ProbingPolicy(INTERVAL)
    states = [policy.new(0.0, phase=i / 64) for i in range(64)]
    for state in states:
        for _ in range(10):
            _visit(policy, state, _idle())
    cap = INTERVAL * MAX_BACKOFF
    slots = {int((s.next_at % cap) // (cap / 8)) for s in states}
    assert slots == set(range(8))  # every eighth of the period has visits: no burst of all 64


def test_a_dispatch_snaps_a_backed_off_replica_back_to_the_interval() -> None:
    policy = ProbingPolicy(INTERVAL)
    state = policy.new(0.0, phase=0.0)
    for _ in range(8):
        _visit(policy, state, _idle())
    last, due = state.visited_at, state.next_at
    assert due - last == INTERVAL * MAX_BACKOFF
    assert policy.dispatched(state, last + 5.0)  # moved earlier: at once (its last visit is over an interval ago)
    assert state.next_at == last + 5.0 and not policy.backed_off(state)
    _visit(policy, state, _idle(dispatches=1, in_flight=1))
    assert state.next_at - state.visited_at == INTERVAL  # busy: every interval
    _visit(policy, state, _idle(dispatches=1, in_flight=0))  # nothing new, nothing in flight: backs off again
    assert state.next_at - state.visited_at > INTERVAL


def test_a_dispatch_right_after_a_visit_waits_one_interval() -> None:
    policy = ProbingPolicy(INTERVAL)
    state = policy.new(0.0, phase=0.5)
    for _ in range(6):
        _visit(policy, state, _idle())
    policy.dispatched(state, state.visited_at + 0.1)
    assert state.next_at == state.visited_at + INTERVAL


def test_load_from_elsewhere_keeps_it_at_the_interval() -> None:
    policy = ProbingPolicy(INTERVAL)
    state = policy.new(0.0, phase=0.0)
    for _ in range(5):
        _visit(policy, state, _idle(engine_load=3.0))  # another gateway's requests
        assert state.period_s == INTERVAL


def test_unhealthy_and_draining_replicas_are_probed_at_the_interval_with_health() -> None:
    policy = ProbingPolicy(INTERVAL)
    for seen in (_idle(healthy=False, scraped=False), _idle(shutting_down=True, scraped=False)):
        state = policy.new(0.0, phase=0.2)
        for _ in range(6):
            _visit(policy, state, seen, health_ok=seen.healthy)
            assert state.next_at - state.visited_at == INTERVAL


def test_a_busy_replica_is_visited_every_interval() -> None:
    """Every visit probes /health: a replica whose /health turns 503 while it still answers requests and scrapes
    (vLLM told to drain, the chaos suite's "unhealthy") shows it within an interval while it has load."""
    policy = ProbingPolicy(INTERVAL)
    state = policy.new(0.0, phase=0.0)
    for n in range(1, 20):
        _visit(policy, state, _idle(dispatches=n, in_flight=1))
        assert state.next_at - state.visited_at == INTERVAL


def test_a_failure_asks_for_health_at_once_but_one_probe_per_interval() -> None:
    policy = ProbingPolicy(INTERVAL)
    state = policy.new(0.0, phase=0.0)
    for _ in range(8):
        _visit(policy, state, _idle())
    now = state.visited_at + 7.0
    assert policy.failed(state, now) and state.next_at == now
    assert not policy.failed(state, now + 0.1)  # a burst of failures: one probe
    now = state.next_at
    policy.health_answered(state, True)
    policy.visited(state, now, _idle())
    assert state.period_s == 2 * INTERVAL  # /health says it serves: idle, it backs off again from the interval
    assert policy.failed(state, now + 0.5) and state.next_at == now + INTERVAL  # one interval after the last visit


def test_a_failed_scrape_or_timed_out_probe_brings_health_at_the_interval() -> None:
    policy = ProbingPolicy(INTERVAL)
    state = policy.new(0.0, phase=0.0)
    for _ in range(8):
        _visit(policy, state, _idle())
    now = state.next_at
    policy.visited(state, now, _idle(scraped=False))
    assert state.next_at == now + INTERVAL and state.health_wanted
    policy.health_failed(state)  # timed out: at the interval again
    policy.visited(state, state.next_at, _idle())
    assert state.period_s == INTERVAL
