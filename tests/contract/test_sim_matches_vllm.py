"""The simulator against the real server side by side: same tokenizer files, so token counts must be identical.

The gateway classifies requests by prompt length and the simulator stands in for vLLM in most tests, so a chat
rendering the simulator gets wrong (tools, tool results, thinking modes, content parts) would silently mis-size
requests everywhere else.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.contract.support import Backend

pytestmark = pytest.mark.vllm

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {"type": "integer"}}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'},
}

TOKENIZE_REQUESTS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "Hello there, how are you?"}]},
    "system": {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]},
    "content_parts": {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    },
    "no_generation_prompt": {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
    "continue_final": {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "partial ans"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "thinking_enabled": {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"thinking_mode": "enabled"},
    },
    "thinking_disabled": {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"thinking_mode": "disabled"},
    },
    "thinking_adaptive": {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"thinking_mode": "adaptive"},
    },
    "tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
    "tool_round_trip": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning": "I should call the tool.", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
        ],
        "tools": TOOLS,
    },
    "assistant_reasoning_content_alias": {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "thought"},
            {"role": "user", "content": "q2"},
        ]
    },
    "completion_form": {"prompt": "Plain text prompt, with punctuation; numbers 12345 and ünïcödé."},
    # The template loops over content parts, so vLLM passes parts through ("openai" content format).
    "system_content_parts": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"role": "user", "content": [{"type": "refusal", "refusal": "c"}, {"type": "text", "text": "d"}]},
        ]
    },
    "tool_result_parts": {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sun"},
                                                                   {"type": "text", "text": "ny"}]},
        ],
        "tools": TOOLS,
    },
    "continue_final_parts": {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "text", "text": "par"}, {"type": "text", "text": "tial"}]},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    # The template has no "developer" role: developer messages become system ones, merged at the front.
    "developer_role": {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "developer", "content": "d"},
            {"role": "system", "content": "s"},
        ]
    },
    "unparsable_tool_arguments": {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]},
        ],
        "tools": TOOLS,
    },
}


@pytest.mark.parametrize("name", sorted(TOKENIZE_REQUESTS))
async def test_tokenize_identical(name: str, sim_backend: Backend, vllm_backend: Backend) -> None:
    body = {**TOKENIZE_REQUESTS[name], "return_token_strs": True}
    async with httpx.AsyncClient(timeout=30.0) as client:
        real = await client.post(f"{vllm_backend.url}/tokenize", json=body)
        sim = await client.post(f"{sim_backend.url}/tokenize", json=body)
    assert real.status_code == 200, real.text
    assert sim.status_code == real.status_code, sim.text
    assert sim.json() == real.json()


async def test_model_cards_agree(sim_backend: Backend, vllm_backend: Backend) -> None:
    async with httpx.AsyncClient(timeout=30.0) as client:
        real = (await client.get(f"{vllm_backend.url}/v1/models")).json()["data"][0]
        sim = (await client.get(f"{sim_backend.url}/v1/models")).json()["data"][0]
    varying = {"created", "root", "permission"}  # a clock, a path, random ids
    assert {k: v for k, v in sim.items() if k not in varying} == {k: v for k, v in real.items() if k not in varying}
