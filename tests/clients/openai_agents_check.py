"""The OpenAI Agents SDK against the gateway: a function-tool loop over `OpenAIChatCompletionsModel`, plain and
streamed, with MiniMax-M3's thinking on and off. Prints what the agent saw as JSON (tests/clients/_check.py)."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import json
from typing import Any

from _check import run_all, thinking
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

set_tracing_disabled(True)  # traces would be exported to OpenAI's servers
CALLS: list[dict[str, Any]] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    CALLS.append({"city": city})
    return f"Sunny in {city}, 21 C."


def _agent(client: AsyncOpenAI, args: Any, think: bool) -> Agent:
    # tool_choice="required" forces the first turn to call the tool; the SDK resets it to auto afterwards
    # (reset_tool_choice), so the model answers in words once it has the tool's result.
    settings = ModelSettings(tool_choice="required", max_tokens=300, extra_body=thinking(think))
    return Agent(name="weather", instructions="Use the tool, then answer briefly.", tools=[get_weather],
                 model=OpenAIChatCompletionsModel(model=args.model, openai_client=client), model_settings=settings)


def _items(result: Any) -> dict[str, Any]:
    kinds = [item.type for item in result.new_items]
    sent = [json.loads(item.raw_item.arguments) for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    reasoning = [item for item in result.new_items if item.type == "reasoning_item"]
    return {"items": kinds, "tool_arguments": sent, "tool_outputs": outputs, "calls": list(CALLS),
            "reasoning_items": len(reasoning), "final_output": result.final_output,
            "model_requests": len(result.raw_responses)}


async def _loop(args: Any, think: bool, stream: bool) -> dict[str, Any]:
    CALLS.clear()
    async with AsyncOpenAI(base_url=args.base_url, api_key="not-used", max_retries=0, timeout=60) as client:
        return await _run(_agent(client, args, think), stream)


async def _run(agent: Agent, stream: bool) -> dict[str, Any]:
    if not stream:
        return _items(await Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
    deltas = 0
    reasoning_deltas = 0
    async for event in result.stream_events():
        if event.type == "raw_response_event":
            kind = getattr(event.data, "type", "")
            deltas += kind == "response.output_text.delta"
            reasoning_deltas += kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta")
    return {**_items(result), "text_deltas": deltas, "reasoning_deltas": reasoning_deltas}


def scenario(think: bool, stream: bool):
    return lambda args: asyncio.run(_loop(args, think, stream))


if __name__ == "__main__":
    run_all({"loop": scenario(False, False), "loop_thinking": scenario(True, False),
             "stream": scenario(False, True), "stream_thinking": scenario(True, True)},
            {name: md.version(name) for name in ("openai-agents", "openai")})
