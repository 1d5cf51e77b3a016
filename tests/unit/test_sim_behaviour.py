"""MiniMax-M3 answer plans: deterministic, within max_tokens, thinking modes and tool calls as documented."""

from __future__ import annotations

import json

import pytest

from pools.sim.behaviour import TOOL_TAG, native_tool_call, plan_output
from pools.sim.protocol import ApiError

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"},
                                     "mode": {"type": "string", "enum": ["fast", "deep"]}}, "required": ["q", "n"]}}}]


def test_plans_are_deterministic_per_seed_and_prompt() -> None:
    a = plan_output(seed=1, fingerprint=42, max_tokens=500, chat=True)
    b = plan_output(seed=1, fingerprint=42, max_tokens=500, chat=True)
    others = {plan_output(seed=s, fingerprint=f, max_tokens=500, chat=True).total_tokens
              for s in range(3) for f in range(20)}
    assert (a.reasoning_tokens, a.content_tokens, a.finish_reason) == (b.reasoning_tokens, b.content_tokens,
                                                                       b.finish_reason)
    assert len(others) > 10


def test_length_never_exceeds_max_tokens_and_ignore_eos_uses_all_of_it() -> None:
    for f in range(50):
        plan = plan_output(seed=0, fingerprint=f, max_tokens=100, chat=True, mean_output_tokens=120)
        assert 1 <= plan.total_tokens <= 100
        assert plan.finish_reason == ("length" if plan.total_tokens == 100 else "stop")
    assert plan_output(seed=0, fingerprint=1, max_tokens=77, chat=True, ignore_eos=True).total_tokens == 77
    assert plan_output(seed=0, fingerprint=1, max_tokens=9, chat=False, mean_output_tokens=0).finish_reason == "length"


def test_thinking_modes() -> None:
    enabled = [plan_output(seed=0, fingerprint=f, max_tokens=50, chat=True, thinking_mode="enabled")
               for f in range(20)]
    disabled = [plan_output(seed=0, fingerprint=f, max_tokens=50, chat=True, thinking_mode="disabled")
                for f in range(20)]
    adaptive = [plan_output(seed=0, fingerprint=f, max_tokens=50, chat=True) for f in range(40)]
    assert all(p.reasoning_tokens > 0 and p.content_tokens > 0 for p in enabled)
    assert all(p.reasoning_tokens == 0 for p in disabled)
    assert 0 < sum(p.reasoning_tokens > 0 for p in adaptive) < 40
    assert all(plan_output(seed=0, fingerprint=f, max_tokens=50, chat=False, thinking_mode="enabled")
               .reasoning_tokens == 0 for f in range(5))


def test_reasoning_comes_before_content_in_the_token_stream() -> None:
    plan = plan_output(seed=0, fingerprint=3, max_tokens=30, chat=True, thinking_mode="enabled", ignore_eos=True)
    kinds = [plan.piece(i)[0] for i in range(plan.total_tokens)]
    assert kinds == ["reasoning"] * plan.reasoning_tokens + ["content"] * plan.content_tokens


def test_required_tool_choice_calls_a_tool_with_schema_shaped_arguments() -> None:
    plan = plan_output(seed=0, fingerprint=9, max_tokens=400, chat=True, tools=TOOLS, tool_choice="required")
    call = plan.tool_call
    assert call is not None and plan.finish_reason == "tool_calls" and plan.content_tokens == 0
    args = json.loads(call.arguments)
    assert set(args) == {"q", "n"} and isinstance(args["q"], str) and isinstance(args["n"], int)
    assert call.tokens == -(-len(native_tool_call("lookup", args).encode()) // 4)


def test_named_tool_choice_keeps_finish_stop_and_none_never_calls() -> None:
    named = plan_output(seed=0, fingerprint=9, max_tokens=400, chat=True, tools=TOOLS,
                        tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert named.tool_call is not None and named.finish_reason == "stop"
    assert all(plan_output(seed=0, fingerprint=f, max_tokens=400, chat=True, tools=TOOLS, tool_choice="none")
               .tool_call is None for f in range(20))


def test_auto_tool_choice_calls_on_some_prompts_and_too_small_budgets_fall_back_to_text() -> None:
    auto = [plan_output(seed=0, fingerprint=f, max_tokens=400, chat=True, tools=TOOLS, tool_choice="auto")
            for f in range(40)]
    assert 0 < sum(p.tool_call is not None for p in auto) < 40
    tiny = plan_output(seed=0, fingerprint=9, max_tokens=3, chat=True, tools=TOOLS, tool_choice="required")
    assert tiny.tool_call is None and tiny.total_tokens <= 3


def test_native_tool_syntax_uses_the_minimax_prefix() -> None:
    text = native_tool_call("f", {"a": 1})
    assert text.startswith(f"{TOOL_TAG}<tool_call>{TOOL_TAG}<invoke name=\"f\">")
    assert text.endswith(f"{TOOL_TAG}</invoke>{TOOL_TAG}</tool_call>")


def test_a_tool_function_that_is_not_an_object_is_a_400_whatever_the_plan() -> None:
    """vLLM refuses it in its request model, before any plan: the simulator too, whether or not its plan calls a tool."""
    bad = [{"type": "function", "function": "x"}, *TOOLS, {"type": "function", "function": None}]
    for fingerprint in range(10):
        for choice in (None, "auto", "required"):
            with pytest.raises(ApiError) as caught:
                plan_output(seed=0, fingerprint=fingerprint, max_tokens=100, chat=True, tools=bad, tool_choice=choice)
            err = json.loads(caught.value.body())["error"]
            assert (err["type"], err["code"], err["param"]) == ("Bad Request", 400, "body.tools.0.function")
            assert err["message"].startswith("2 validation errors:\n  {'type': 'model_attributes_type', "
                                             "'loc': 'body.tools.0.function'")
            assert "'loc': 'body.tools.2.function'" in err["message"] and "'input': 'None'" in err["message"]
    assert plan_output(seed=0, fingerprint=1, max_tokens=100, chat=True, tools=TOOLS, tool_choice="required").tool_call
