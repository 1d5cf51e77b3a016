"""The interactive mix the SLO and prediction benchmarks share: 60% independent chats and 40% agent-session turns at
the asked rate, sessions sized by their mean turn count."""

from __future__ import annotations

from loadtests.bench.predictions_vllm import spec as predictions_spec
from loadtests.bench.slo import interactive_spec
from loadtests.lib.workload import build_plan


def test_the_mix_is_sixty_percent_chats_at_the_asked_rate() -> None:
    for spec in (interactive_spec(4.0, 600.0, seed=5), predictions_spec(4.0, 600.0, seed=5)):
        plan = build_plan(spec)
        chats = len(plan.independent())
        turns = sum(len(t) for t in plan.sessions().values())
        assert 0.55 < chats / (chats + turns) < 0.65, (spec["name"], chats, turns)
        assert 0.85 * 4.0 * 600 < chats + turns < 1.15 * 4.0 * 600, (spec["name"], chats + turns)
