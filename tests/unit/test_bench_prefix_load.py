"""bench_prefix_load's workloads and goal checks (the benchmark itself runs against SGLang's router: `python -m
loadtests.bench.prefix_load`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from loadtests.bench.prefix_load import Shape, checks, gateway_config


def test_the_uniform_shape_is_inference_perfs_shared_prefix_at_the_issue_size() -> None:
    plan = Shape().plan(5.0)
    groups = Counter(i.prefix_group for i in plan.items)
    assert len(plan.items) == 120 and len(groups) == 24 and set(groups.values()) == {5}
    assert [i.index for i in plan.items] == list(range(120))
    times = [i.at for i in plan.items]
    assert times == sorted(times) and 15 < times[-1] < 35  # Poisson at 5/s: ~24 s
    first = plan.items[0].body
    assert first["stream"] and first["max_tokens"] == 100
    assert first["messages"][0]["role"] == "system" and len(first["messages"][0]["content"].split()) == 6000


def test_each_seed_draws_its_own_order_and_arrivals_of_the_same_requests() -> None:
    """The replicas are deterministic, so rounds on one seed would repeat one sample: each round has its own."""
    one, other = Shape().plan(7.5), replace(Shape(), seed=Shape.seed + 1).plan(7.5)
    assert [i.at for i in one.items] != [i.at for i in other.items]
    assert [i.prefix_group for i in one.items] != [i.prefix_group for i in other.items]
    assert Counter(i.prefix_group for i in one.items) == Counter(i.prefix_group for i in other.items)
    assert [i.at for i in Shape().plan(7.5).items] == [i.at for i in one.items]


def test_the_hot_shape_puts_half_the_requests_on_one_group_mixed_through_the_run() -> None:
    plan = replace(Shape(), per_group=10, hot_share=0.5).plan(10.0)
    groups = Counter(i.prefix_group for i in plan.items)
    assert len(plan.items) == 240 and len(groups) == 24
    hot, count = groups.most_common(1)[0]
    assert count == 120 and all(4 <= n <= 6 for g, n in groups.items() if g != hot)
    halves = [sum(1 for i in part if i.prefix_group == hot) for part in (plan.items[:120], plan.items[120:])]
    assert all(40 <= n <= 80 for n in halves), halves  # shuffled, not the other groups first


def test_never_move_opens_every_rule_that_moves_a_request() -> None:
    routing = gateway_config(["http://127.0.0.1:1"], "never_move")["routing"]
    assert routing["placement"]["move_cost_factor"] == float("inf")
    assert routing["load_epsilon"] >= 10 and routing["load_slack"] >= 1000
    assert gateway_config(["http://127.0.0.1:1"], "m3gate", {"load_slack": 3})["routing"]["load_slack"] == 3


def _row(**fields: float) -> dict[str, float]:
    return {"of_oracle": 0.99, "ttft_p50": 100.0, "ttft_p90": 500.0, "req_s": 5.0, **fields}


def test_the_checks_compare_with_sglang_and_never_move_and_can_fail() -> None:
    rows = {"2.5": {"m3gate": _row(), "sglang": _row()},
            "7.5": {"m3gate": _row(of_oracle=0.9, ttft_p90=600.0), "sglang": _row(req_s=5.5)}}
    result = {c["name"]: c["ok"] for c in checks("uniform", rows)}
    assert result["2.5/s: m3gate hit rate ≥ 0.97 × oracle"] and result["2.5/s: m3gate ttft_p90 ≤ SGLang's"]
    assert not result["7.5/s: m3gate hit rate ≥ 0.97 × oracle"]
    assert not result["7.5/s: m3gate ttft_p90 ≤ SGLang's"]
    assert not result["7.5/s: m3gate completed req/s ≥ SGLang's"]
    assert "2.5/s: m3gate completed req/s ≥ SGLang's" not in result  # only at the highest rate
    hot = {"10": {"m3gate": _row(ttft_p90=790.0), "never_move": _row(ttft_p90=1000.0)}}
    assert [c["ok"] for c in checks("hot", hot)] == [True]
    hot["10"]["m3gate"]["ttft_p90"] = 810.0
    assert [c["ok"] for c in checks("hot", hot)] == [False]
