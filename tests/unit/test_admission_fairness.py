"""Session-fair ordering, pure: within an API key's turn the waiter of the session with the least attained service
goes first, a session's burst does not starve the others, a lone session keeps exactly the order by arrival, and the
per-session record decays and stays bounded whatever the number of sessions."""

from __future__ import annotations

import random

import pytest

from gateway.admission import fairness_session
from gateway.record import RequestRecord
from policies.admission import (
    AGING,
    SERVICE_EXPIRY_S,
    SERVICE_HALF_LIFE_S,
    FairQueue,
    PoolGate,
    ServiceLedger,
    Waiter,
)


def _w(session: str, t: float, key: str = "k", priority: int = 0, by_session: bool = True) -> Waiter:
    return Waiter("interactive", key, priority, t, session=session, charge=100.0, by_session=by_session)


def _serve_all(queue: FairQueue, ledger: ServiceLedger, now: float) -> list[str]:
    """Serve one at a time as admission does: each admitted request is charged to its session while it runs."""
    out = []
    while len(queue):
        first = queue.order(now)[0]
        queue.serve(first)
        ledger.admitted(first.session, first.charge, now)
        out.append(first.session)
    return out


def test_a_sessions_burst_does_not_starve_the_other_sessions() -> None:
    ledger = ServiceLedger()
    ledger.admitted("heavy", 100.0, 0.0)  # its first request holds the only slot
    queue = FairQueue(ledger)
    for t in range(7):
        queue.push(_w("heavy", t * 0.01))
    for i in range(4):
        queue.push(_w(f"light{i}", 1.0 + i))
    assert _serve_all(queue, ledger, 2.0) == ["light0", "light1", "light2", "light3", *["heavy"] * 7]


def test_by_key_the_same_burst_is_served_first_come_first_served() -> None:
    ledger = ServiceLedger()
    ledger.admitted("heavy", 100.0, 0.0)
    queue = FairQueue(ledger)
    for t in range(7):
        queue.push(_w("heavy", t * 0.01, by_session=False))
    for i in range(4):
        queue.push(_w(f"light{i}", 1.0 + i, by_session=False))
    assert _serve_all(queue, ledger, 2.0) == [*["heavy"] * 7, "light0", "light1", "light2", "light3"]


def test_two_bursting_sessions_alternate() -> None:
    ledger = ServiceLedger()
    queue = FairQueue(ledger)
    for t in range(4):
        queue.push(_w("a", t))
    for t in range(4):
        queue.push(_w("b", 10 + t))
    assert _serve_all(queue, ledger, 20.0) == ["a", "b"] * 4


def test_keys_stay_round_robin_above_sessions() -> None:
    ledger = ServiceLedger()
    ledger.ended("k1\0busy", 0.0, 50_000.0, 100.0, 0.0)  # key k1's session has had much service lately
    queue = FairQueue(ledger)
    for t in range(3):
        queue.push(_w("k1\0busy", t, key="k1"))
    queue.push(_w("k2\0x", 5, key="k2"))
    queue.push(_w("k1\0fresh", 6, key="k1"))
    # k1 keeps its first turn (its fresh session takes it), k2 gets the next; k1's busy session waits
    assert _serve_all(queue, ledger, 7.0) == ["k1\0fresh", "k2\0x", "k1\0busy", "k1\0busy", "k1\0busy"]


@pytest.mark.parametrize("seed", range(20))
def test_a_lone_session_per_key_loses_nothing_against_the_order_by_key(seed: int) -> None:
    """Random arrivals, serves and departures: with one session per key, `fairness: session` admits exactly what
    `fairness: key` (the order by key round-robin, then arrival) admits, in the same order."""
    rng = random.Random(seed)
    ledger = ServiceLedger()
    for k in range(3):
        ledger.ended(f"s{k}", 0.0, rng.uniform(0, 10_000), 10.0, 0.0)
    queues = {mode: FairQueue(ledger) for mode in (True, False)}
    twins: dict[bool, list[Waiter]] = {True: [], False: []}
    served: dict[bool, list[int]] = {True: [], False: []}
    queued: set[int] = set()
    for step in range(300):
        op = rng.random()
        if op < 0.5:
            key, prio = rng.randrange(3), rng.randrange(2)
            for mode, queue in queues.items():
                w = Waiter("c", f"k{key}", prio, float(step), session=f"s{key}", charge=10.0, by_session=mode)
                queue.push(w)
                twins[mode].append(w)
            queued.add(len(twins[True]) - 1)
        elif op < 0.85:
            for mode, queue in queues.items():
                if len(queue):
                    first = queue.order(float(step))[0]
                    queue.serve(first)
                    served[mode].append(twins[mode].index(first))
            queued.discard(served[True][-1] if served[True] else -1)
        elif queued:
            i = rng.choice(sorted(queued))
            queued.discard(i)
            for mode, queue in queues.items():
                assert queue.remove(twins[mode][i])
    assert served[True] == served[False]
    assert len(served[True]) > 50


def test_attained_service_decays_by_half_each_half_life_and_running_charges_do_not() -> None:
    ledger = ServiceLedger()
    ledger.ended("s", 0.0, 1000.0, 200.0, 0.0)
    assert ledger.attained("s", SERVICE_HALF_LIFE_S) == pytest.approx(500.0)
    assert ledger.attained("s", 2 * SERVICE_HALF_LIFE_S) == pytest.approx(250.0)
    ledger.admitted("s", 300.0, 2 * SERVICE_HALF_LIFE_S)  # running now: counted whole while it runs
    assert ledger.attained("s", 3 * SERVICE_HALF_LIFE_S) == pytest.approx(125.0 + 300.0)
    ledger.ended("s", 300.0, 40.0, 10.0, 3 * SERVICE_HALF_LIFE_S)  # its charge is replaced by what it got
    assert ledger.attained("s", 3 * SERVICE_HALF_LIFE_S) == pytest.approx(125.0 + 40.0)
    record = ledger.get("s")
    assert record is not None and record.answers == pytest.approx(1 / 8 + 1.0)  # decayed answer count
    assert record.output == pytest.approx(200.0 / 8 + 10.0)  # what an output-length estimate can read


def test_old_service_decays_below_recent_smaller_service() -> None:
    ledger = ServiceLedger()
    ledger.ended("old", 0.0, 100_000.0, 0.0, 0.0)
    ledger.ended("recent", 0.0, 2_000.0, 0.0, 9 * SERVICE_HALF_LIFE_S)
    queue = FairQueue(ledger)
    queue.push(_w("recent", 9 * SERVICE_HALF_LIFE_S))
    queue.push(_w("old", 9 * SERVICE_HALF_LIFE_S + 1))
    assert [w.session for w in queue.order(9 * SERVICE_HALF_LIFE_S + 2)] == ["old", "recent"]  # 195 < 2000


def test_memory_is_bounded_whatever_the_number_of_sessions() -> None:
    ledger = ServiceLedger(max_records=1000)
    for i in range(50_000):
        ledger.admitted(f"s{i}", 10.0, i * 0.001)
        ledger.ended(f"s{i}", 10.0, 20.0, 5.0, i * 0.001)
        assert len(ledger) <= 1000
    assert ledger.get("s49999") is not None and ledger.get("s0") is None  # the least recently served went


def test_records_expire_with_their_window_unless_running() -> None:
    ledger = ServiceLedger()
    for i in range(20):
        ledger.ended(f"idle{i}", 0.0, 100.0, 1.0, 0.0)
    ledger.admitted("running", 50.0, 0.0)
    later = SERVICE_EXPIRY_S + 1
    for i in range(10):
        ledger.ended(f"new{i}", 0.0, 1.0, 1.0, later + i)  # each new record sweeps a few expired ones
    assert all(ledger.get(f"idle{i}") is None for i in range(20))
    assert ledger.get("running") is not None and ledger.attained("running", later) == pytest.approx(50.0)
    assert len(ledger) == 11


def test_the_gate_admits_light_sessions_first_through_its_shared_ledger() -> None:
    ledger = ServiceLedger()
    gate = PoolGate.with_ledger(ledger)
    ledger.admitted("heavy", 500.0, 0.0)
    for t in range(3):
        gate.queue.push(_w("heavy", t))
    gate.queue.push(_w("light", 5))
    admitted = gate.admit_waiting({"interactive": 1}, saturated=False, now=6.0)
    assert [w.session for w in admitted] == ["light"]


def test_a_request_without_a_session_is_its_own_session() -> None:
    ledger = ServiceLedger()
    ledger.admitted("heavy", 100.0, 0.0)
    queue = FairQueue(ledger)
    heavy = [_w("heavy", t) for t in range(3)]
    alone = [_w("", 10 + t) for t in range(2)]  # the gateway knows no session of these: nothing charged to them
    for w in (*heavy, *alone):
        queue.push(w)
    assert queue.order(20.0) == [*alone, *heavy]
    assert ledger.get("") is None


def test_the_fairness_session_is_the_derived_session_scoped_by_key() -> None:
    record = RequestRecord(api="chat", stream=False, t_arrival=0.0)
    assert fairness_session(record, "alice", None) == ""  # no session known: its own, charged nowhere
    assert fairness_session(record, "alice", "s1") == "alice\0s1"
    assert fairness_session(record, "bob", "s1") != fairness_session(record, "alice", "s1")

    class FirstTurn:
        session_id = "first-turn-7"

    record.session = FirstTurn()  # the session tracker's turn wins over the sticky key
    assert fairness_session(record, "alice", "s1") == "alice\0first-turn-7"


def test_waiting_earns_credit_so_a_heavy_session_is_held_back_only_so_long() -> None:
    """A session's past service holds its request back by 1 / AGING times the time the pool took to serve that
    much: with the pool serving 1,000 / AGING tokens/s, 5,000 tokens of attained service put it 5 s behind the
    order of arrival."""
    ledger = ServiceLedger()
    ledger.ended("heavy", 0.0, 5_000.0, 0.0, 0.0)
    queue = FairQueue(ledger)
    queue.push(_w("heavy", 0.0))
    queue.push(_w("light_a", 3.0))  # a fresh session, 3 s later: goes first
    queue.push(_w("light_b", 6.0))  # another, 6 s later: after heavy
    assert [w.session for w in queue.order(7.0, served_per_s=1_000.0 / AGING)] == ["light_a", "heavy", "light_b"]
    assert [w.session for w in queue.order(7.0, served_per_s=0.0)] == ["light_a", "light_b", "heavy"]  # plain LAS


def _gate_serving(tokens_per_s: float) -> PoolGate:
    gate = PoolGate.with_ledger(ServiceLedger())
    for t in range(10):
        gate.take_slot("interactive")
        gate.free_slot("interactive", float(t), served=tokens_per_s)
    return gate


@pytest.mark.parametrize(("light_at", "first"), [(0.5, "light"), (1.5, "light"), (2.5, "heavy"), (9.0, "heavy")])
def test_the_gate_credits_waiters_with_the_tokens_its_pool_served(light_at: float, first: str) -> None:
    gate = _gate_serving(2_000.0 / AGING)
    assert gate.drain.tokens_per_second(10.0) == pytest.approx(2_000.0 / AGING)
    gate.queue.ledger.ended("heavy", 0.0, 4_000.0, 0.0, 10.0)  # held back 2 s
    gate.queue.push(_w("heavy", 0.0))
    gate.queue.push(_w("light", light_at))
    admitted = gate.admit_waiting({"interactive": 1}, saturated=False, now=10.0)
    assert [w.session for w in admitted] == [first]


def test_a_turn_is_charged_its_prompt_growth_over_the_sessions_last_prompt() -> None:
    ledger = ServiceLedger()
    assert ledger.turn_charge("s", 40_000.0, 0.0) == 40_000.0  # a new session: all of it misses
    assert ledger.turn_charge("s", 43_000.0, 1.0) == 3_000.0  # the next turn: what it added
    assert ledger.turn_charge("s", 10_000.0, 2.0) == 10_000.0  # a shorter prompt: another context
    assert ledger.turn_charge("", 5_000.0, 3.0) == 5_000.0 and ledger.get("") is None  # no session: its own
