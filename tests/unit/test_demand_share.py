"""policies/demand_share.py: a gateway's demand share survives the wire, malformed ones are refused, and merging adds
what adds (rates, token sums, queues, backlogs), weighs the learnt costs by the samples behind them and keeps the
largest signal memory for seeding."""

from __future__ import annotations

import orjson
import pytest

from policies.demand_share import (
    COST_MEMORY,
    CostShare,
    DemandShare,
    StableShare,
    decode,
    encode,
    merge,
    merge_costs,
    peaks,
)


def _share(rate: float, answered: float, prompt_mean: float, queued: float = 0.0, backlog: float = 0.0,
           costs: CostShare | None = None, stable: StableShare | None = None) -> DemandShare:
    key = ("chat", "interactive")
    return DemandShare(
        rates={key: rate},
        sums={key: [answered, answered, prompt_mean * answered, 0.5 * prompt_mean * answered, 100.0 * answered,
                    prompt_mean * answered]},
        queued={key: queued}, backlog={("chat", "both"): backlog},
        costs={"chat": costs or CostShare()},
        stable={("chat", "both"): stable} if stable else {})


def test_a_share_survives_the_wire() -> None:
    share = _share(3.25, 40, 2000, queued=2, backlog=5000,
                   costs=CostShare((0.03, 0.08), 150, (0.015, 3e-4, 1e-5), 90, 400_000),
                   stable=StableShare(4, 12.5, ((10.0, 3), (5.0, 4))))
    share.rates[("long", "repository")] = 0.5  # a class without sums (arrived, none finished yet)
    back = decode(encode(share))
    assert back.rates == share.rates and back.backlog == share.backlog
    assert back.sums == {**share.sums, ("long", "repository"): [0.0] * 6}
    assert back.queued[("chat", "interactive")] == 2 and back.queued[("long", "repository")] == 0
    assert back.costs == share.costs and back.stable == share.stable
    share.trends["chat"] = (0.05, 0.0004)
    share.latency[("chat", "interactive")] = (1.25, None)
    back = decode(encode(share))
    assert back.trends == share.trends and back.latency == share.latency
    assert len(encode(share)) < 450  # a tick's whole publication for two classes and a pool


@pytest.mark.parametrize("blob", [
    b"not json", b"[]", orjson.dumps({"v": 99, "c": [], "b": [], "k": [], "s": []}),
    orjson.dumps({"v": 1, "c": [["chat", "i", 1.0, 0.0, 1.0]], "b": [], "k": [], "s": []}),  # sums missing
    orjson.dumps({"v": 1, "c": [], "b": [["chat", "both"]], "k": [], "s": []}),
    orjson.dumps({"v": 1, "c": [], "b": [], "k": [], "s": [["chat", "both", "many", 1, []]]}),
    orjson.dumps({"v": 1, "c": []}),
])
def test_a_malformed_share_is_refused(blob: bytes) -> None:
    with pytest.raises(ValueError):
        decode(blob)


def test_rates_sums_queues_and_backlogs_add_and_the_mix_is_the_weighted_one() -> None:
    a = _share(3.0, 30, 1000, queued=1, backlog=1000)
    b = _share(1.0, 10, 5000, queued=4, backlog=9000)
    merged = merge([a, b])
    key = ("chat", "interactive")
    assert merged.gateways == 2
    assert merged.rates[key] == 4.0 and merged.queued[key] == 5 and merged.backlog[("chat", "both")] == 10_000
    sums = merged.sums[key]
    assert sums[1] == 40 and sums[2] / sums[1] == pytest.approx(2000.0)  # (30·1000 + 10·5000) / 40, not 3000
    # a class only one gateway saw is kept as it is; the inputs are not modified
    b.rates[("long", "repository")] = 0.25
    assert merge([a, b]).rates[("long", "repository")] == 0.25 and a.sums[key][1] == 30


def test_trends_add_and_the_largest_measured_p95_is_kept() -> None:
    a, b = _share(3.0, 30, 1000), _share(1.0, 10, 5000)
    a.trends["chat"], b.trends["chat"] = (0.2, 0.01), (-0.05, 0.04)
    a.latency[("chat", "interactive")] = (0.8, 0.05)
    b.latency[("chat", "interactive")] = (2.5, None)
    b.latency[("chat", "repository")] = (None, 0.12)
    merged = merge([a, b])
    assert merged.trends["chat"] == pytest.approx((0.15, 0.05))  # independent arrivals: slopes and variances add
    assert merged.latency[("chat", "interactive")] == (2.5, 0.05)  # at risk behind any gateway: at risk
    assert merged.latency[("chat", "repository")] == (None, 0.12)
    # a share published without trends or latencies (an older gateway) still decodes
    old = orjson.loads(encode(a))
    del old["t"], old["l"]
    assert decode(orjson.dumps(old)).trends == {}


def test_costs_are_weighted_by_their_samples_capped_at_the_learners_memory() -> None:
    young = CostShare((0.04, 0.10), 50, (0.030, 4e-4, 0.0), 50, 300_000)
    old = CostShare((0.02, 0.06), 10_000, (0.010, 2e-4, 2e-5), 10_000, 200_000)
    merged = merge_costs([young, old])
    w_young, w_old = 50 / (50 + COST_MEMORY), COST_MEMORY / (50 + COST_MEMORY)  # old counts as COST_MEMORY, not 10K
    assert merged.prefill == pytest.approx((0.04 * w_young + 0.02 * w_old, 0.10 * w_young + 0.06 * w_old))
    assert merged.decode[0] == pytest.approx(0.030 * w_young + 0.010 * w_old)
    assert merged.kv_tokens == 200_000  # the smallest reported
    # nobody learnt anything yet: the plain mean (both at the defaults: the defaults)
    fresh = merge_costs([CostShare(), CostShare(kv_tokens=None)])
    assert fresh.prefill == pytest.approx(CostShare().prefill) and fresh.kv_tokens is None
    # a gateway that learnt outweighs one that did not at all
    assert merge_costs([CostShare(), old]).decode == pytest.approx(old.decode)


def test_the_largest_signal_memory_is_kept_for_seeding() -> None:
    low, high = StableShare(3, 5.0), StableShare(5, 40.0)
    recent = StableShare(5, 2.0)
    merged = merge([_share(1, 1, 1, stable=low), _share(1, 1, 1, stable=high), _share(1, 1, 1, stable=recent)])
    assert merged.stable[("chat", "both")] == recent  # the largest count; of equals, the latest change


def test_the_signal_memory_travels_as_its_peaks_only() -> None:
    history = [(0.0, 3), (5.0, 6), (10.0, 4), (15.0, 6), (20.0, 5), (25.0, 2), (30.0, 2)]
    kept = peaks(history)
    assert kept == ((15.0, 6), (20.0, 5), (30.0, 2))
    for now in range(30, 60):  # the largest count within any window ending at any later time: the same
        for window in (5, 10, 20, 40):
            def peak(points):  # type: ignore[no-untyped-def]
                return max((n for t, n in points if t >= now - window), default=None)
            assert peak(kept) == peak(history), (now, window)
    assert peaks([(float(t), 4) for t in range(60)]) == ((59.0, 4),)  # steady: one point


def test_a_class_failing_outright_stays_failing_on_the_other_gateways() -> None:
    """A measured p95 that is infinite (the class's requests refused for want of capacity) is not "too few
    requests seen" (None) once it crossed the wire, and merging keeps it as the largest."""
    failing = _share(3.0, 30, 1000)
    failing.latency[("chat", "interactive")] = (float("inf"), None)
    failing.latency[("chat", "repository")] = (0.4, float("inf"))
    back = decode(encode(failing))
    assert back.latency[("chat", "interactive")] == (float("inf"), None)
    assert back.latency[("chat", "repository")] == (0.4, float("inf"))
    calm = _share(1.0, 10, 1000)
    calm.latency[("chat", "interactive")] = (0.3, 0.02)
    assert merge([calm, back]).latency[("chat", "interactive")] == (float("inf"), 0.02)
    # JSON itself has no infinity: the wire carries a string that any reader's float() turns back into one
    wire = orjson.loads(encode(failing))["l"]
    assert ["chat", "interactive", "inf", None] in wire and float(wire[0][2]) == float("inf")
    with pytest.raises(ValueError):
        decode(orjson.dumps({**orjson.loads(encode(failing)), "l": [["chat", "interactive", "slow", None]]}))


def test_the_answers_spread_travels_beside_the_six_sums_and_adds() -> None:
    a, b = _share(3.0, 30, 1000), _share(1.0, 10, 5000)
    key = ("chat", "interactive")
    a.output_sq[key], b.output_sq[key] = 30 * 100.0 ** 2, 10 * 120.0 ** 2
    back = decode(encode(a))
    assert back.output_sq == a.output_sq and len(back.sums[key]) == 6  # an older reader's six sums, unchanged
    assert merge([back, b]).output_sq[key] == 30 * 100.0 ** 2 + 10 * 120.0 ** 2
    old = orjson.loads(encode(a))
    del old["q"]  # an older gateway publishes none
    assert decode(orjson.dumps(old)).output_sq == {}
