"""Workload specs the benchmarks share (inputs to `loadtests.lib.workload.build_plan`): the interactive mix of bursty
independent chats and agent-session turns (bench_slo, bench_predictions_vllm), and the agent session's shape
(those two and bench_policies), so the benchmarks differ only in the sizes they choose."""

from __future__ import annotations

from typing import Any

__all__ = ["agent_turns", "interactive_mix", "lognormal", "uniform_int"]

CHAT_SHARE = 0.6  # of the interactive mix's requests
SESSION_SHARE = 0.4  # the rest: agent-session turns


def uniform_int(low: int, high: int) -> dict[str, Any]:
    return {"dist": "uniform_int", "min": low, "max": high}


def lognormal(median: float, sigma: float, low: float, high: float) -> dict[str, Any]:
    return {"dist": "lognormal", "median": median, "sigma": sigma, "min": low, "max": high}


def agent_turns(*, system_tokens: int, tools: int, tool_tokens: int, turns: tuple[int, int],
                first_user: tuple[int, int], user: tuple[int, int], tool_result: dict[str, Any],
                output: tuple[int, int], tool_call_output: tuple[int, int]) -> dict[str, Any]:
    """An agent session's turns: one of 3 system prompts with its tool schemas, a first user message, then turns
    that carry a tool result 70% of the time (a user message otherwise), answered by text or a tool call."""
    return {
        "system_prompts": {"count": 3, "tokens": system_tokens},
        "tools": {"count": tools, "tokens_each": tool_tokens},
        "turns": uniform_int(*turns),
        "first_user_tokens": uniform_int(*first_user),
        "user_tokens": uniform_int(*user),
        "tool_result_share": 0.7,
        "tool_result_tokens": tool_result,
        "output_tokens": uniform_int(*output),
        "tool_call_output_tokens": uniform_int(*tool_call_output),
    }


def interactive_mix(*, name: str, seed: int, rate: float, duration_s: float, drain_s: float, turns_mean: float,
                    chat: dict[str, Any], agent: dict[str, Any]) -> dict[str, Any]:
    """`rate` requests/s: 60% independent chats (the `chat` class, gamma arrivals with burstiness 0.3), 40% turns of
    agent sessions (`agent`, sessions of `turns_mean` turns on average arriving as a Poisson process)."""
    session_rate = SESSION_SHARE * rate / turns_mean
    return {
        "name": name, "seed": seed, "duration_s": duration_s, "drain_s": drain_s,
        "arrival": {"process": "gamma", "rate": CHAT_SHARE * rate, "burstiness": 0.3},
        "classes": [{"name": "chat", **chat}],
        "sessions": [{
            "name": "agent",
            "count": max(1, round(session_rate * duration_s)),
            "arrival": {"process": "poisson", "rate": session_rate},
            **agent,
        }],
    }
