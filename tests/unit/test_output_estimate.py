"""Output-length estimates (policies/output_estimate.py): the prior bucket from the request's fields, the refinement
by the session's, key's and class's outputs, the bounds, and never more than the budget."""

from __future__ import annotations

from typing import Any

import pytest

from policies.output_estimate import OutputEstimator, OutputHints, output_hints

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def hints(body: dict[str, Any], mode: str = "adaptive", budget: int = 16_384) -> OutputHints:
    return output_hints(body, mode, budget)


@pytest.mark.parametrize(("body", "mode", "bucket"), [
    ({}, "adaptive", "medium"),
    ({}, "disabled", "medium"),
    ({"tools": TOOLS}, "disabled", "short"),
    ({}, "enabled", "long"),
    ({"tools": TOOLS}, "adaptive", "medium"),
    ({"tools": TOOLS, "tool_choice": "required"}, "enabled", "short"),  # a forced call is short, thinking or not
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "read"}}}, "adaptive", "short"),
    ({"tools": TOOLS, "tool_choice": {"type": "any"}}, "enabled", "short"),  # Anthropic's
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "read"}}, "adaptive", "short"),
    ({"tools": TOOLS, "tool_choice": "none"}, "disabled", "medium"),  # tools offered but not callable
    ({"tools": TOOLS, "tool_choice": {"type": "none"}}, "disabled", "medium"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "disabled", "short"),
    ({"tools": [], "tool_choice": "required"}, "adaptive", "medium"),  # no tools, nothing forced
])
def test_the_prior_bucket_follows_thinking_mode_tools_and_tool_choice(body: dict[str, Any], mode: str,
                                                                     bucket: str) -> None:
    h = hints(body, mode)
    est = OutputEstimator((100, 400, 1600)).estimate(h, 0.0)
    assert h.prior == bucket
    assert est.bucket == bucket and est.source == "prior"
    assert est.tokens == {"short": 100, "medium": 400, "long": 1600}[bucket]


def test_a_thinking_budget_sizes_the_long_estimate() -> None:
    est = OutputEstimator((100, 400, 1600))
    anthropic = hints({"thinking": {"type": "enabled", "budget_tokens": 8000}}, "enabled")
    chat = hints({"chat_template_kwargs": {"thinking_mode": "enabled", "thinking_budget": 300}}, "enabled")
    assert anthropic.thinking_budget == 8000 and est.estimate(anthropic, 0.0).tokens == 8100
    assert chat.thinking_budget == 300 and est.estimate(chat, 0.0).tokens == 400
    assert est.estimate(chat, 0.0).bucket == "medium"  # the bucket is the estimate's, not the prior's
    for odd in ({"thinking": {"budget_tokens": "many"}}, {"thinking": {"budget_tokens": True}},
                {"thinking": "on"}, {"chat_template_kwargs": {"thinking_budget": -5}}):
        assert hints(odd, "enabled").thinking_budget is None  # an odd field is no hint, never an error


@pytest.mark.parametrize("budget", [1, 50, 99, 401, 5000])
def test_never_above_the_budget(budget: int) -> None:
    est = OutputEstimator((100, 400, 1600))
    thinking = hints({"thinking": {"type": "enabled", "budget_tokens": 10_000}}, "enabled", budget)
    assert 1 <= est.estimate(thinking, 0.0).tokens <= budget
    for _ in range(5):  # learnt from answers longer than this request may be
        est.observe(thinking, 20_000, 1.0, session="s", key="k", cls="c")
    assert est.estimate(thinking, 2.0, session="s", key="k", cls="c").tokens == min(budget, 20_000)


def test_the_session_refines_first_then_the_key_then_the_class() -> None:
    est = OutputEstimator((100, 400, 1600), min_samples=3)
    h = hints({}, "adaptive")
    est.observe(h, 50, 1.0, session="s1", key="k1", cls="chat")
    assert est.estimate(h, 2.0, session="s1", key="k1", cls="chat").tokens == 50  # one turn of its own is enough
    assert est.estimate(h, 2.0, session="s2", key="k1", cls="chat").source == "prior"  # the key's: too few yet
    for tokens in (60, 70):
        est.observe(h, tokens, 3.0, session="s1", key="k1", cls="chat")
    by_key = est.estimate(h, 4.0, session="s2", key="k1", cls="chat")
    assert by_key.source == "key" and 50 <= by_key.tokens <= 70 and by_key.bucket == "short"
    by_class = est.estimate(h, 4.0, key="k2", cls="chat")
    assert by_class.source == "class" and 50 <= by_class.tokens <= 70
    assert est.estimate(h, 4.0, key="k2", cls="batch").source == "prior"


def test_outputs_of_another_prior_bucket_do_not_move_the_estimate() -> None:
    est = OutputEstimator((100, 400, 1600))
    chat, tool_call = hints({}, "adaptive"), hints({"tools": TOOLS, "tool_choice": "required"}, "adaptive")
    for _ in range(3):
        est.observe(chat, 3000, 1.0, session="s")
    assert est.estimate(chat, 2.0, session="s").tokens == 3000
    assert est.estimate(tool_call, 2.0, session="s").tokens == 100  # a forced call after long answers: still short


def test_the_session_follows_its_recent_outputs_and_the_long_tail_weighs_little() -> None:
    est = OutputEstimator((100, 400, 1600), session_alpha=0.5)
    h = hints({}, "adaptive")
    for tokens in (2000, 2000, 60, 60, 60):
        est.observe(h, tokens, 1.0, session="s")
    assert est.estimate(h, 1.0, session="s").tokens < 200  # three recent short answers outweigh two older long ones
    slow = OutputEstimator((100, 400, 1600), alpha=0.1)
    for tokens in [300] * 20 + [30_000]:  # one answer 100× longer than the rest
        slow.observe(h, tokens, 1.0, cls="c")
    assert slow.estimate(h, 1.0, cls="c").tokens < 500  # a geometric mean: 1.6× up, not 100×


def test_memory_is_bounded_and_expires() -> None:
    est = OutputEstimator((100, 400, 1600), ttl_s=60.0, max_sessions=3, max_keys=2)
    h = hints({}, "adaptive")
    for n in range(10):
        est.observe(h, 50, float(n), session=f"s{n}", key=f"k{n}", cls=f"c{n}")
    assert est.view() == {"sessions": 3, "keys": 2, "classes": 2}
    assert est.estimate(h, 10.0, session="s0").source == "prior"  # least recently used: evicted
    assert est.estimate(h, 10.0, session="s9").tokens == 50
    assert est.estimate(h, 100.0, session="s9").source == "prior"  # unseen for more than ttl_s: forgotten
    assert est.view()["sessions"] == 2
    est.observe(h, 500, 200.0, session="s8")  # an expired group starts afresh, not from its stale mean
    assert est.estimate(h, 200.0, session="s8").tokens == 500


def test_empty_answers_teach_nothing() -> None:
    est = OutputEstimator((100, 400, 1600))
    h = hints({}, "adaptive")
    est.observe(h, 0, 1.0, session="s")
    assert est.estimate(h, 1.0, session="s").source == "prior"
    assert est.view() == {"sessions": 0, "keys": 0, "classes": 0}


def test_buckets_split_at_the_geometric_midpoints() -> None:
    est = OutputEstimator((100, 400, 1600))
    assert [est.bucket(t) for t in (1, 199, 200, 799, 800, 10**6)] == \
        ["short", "short", "medium", "medium", "long", "long"]
