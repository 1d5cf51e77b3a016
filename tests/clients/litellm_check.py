"""LiteLLM as a client library against the gateway: the `hosted_vllm/` and `openai/` providers, plain and streamed,
a forced tool call, and MiniMax-M3's reasoning surfacing as `reasoning_content`. Prints what LiteLLM returned as JSON
(tests/clients/_check.py)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
from typing import Any

# Before the import: LiteLLM fetches its model price map from the internet at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
from _check import FORCE_WEATHER, WEATHER_TOOL, run_all, thinking  # noqa: E402

litellm.suppress_debug_info = True
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _call(args: Any, provider: str, **kwargs: Any) -> Any:
    return litellm.completion(model=f"{provider}/{args.model}", api_base=args.base_url, api_key="not-used",
                              messages=QUESTION, max_tokens=300, num_retries=0, timeout=60, **kwargs)


def plain(provider: str):
    def run(args: Any) -> dict[str, Any]:
        out = {}
        for think in (True, False):
            message = _call(args, provider, extra_body=thinking(think)).choices[0].message
            out["thinking" if think else "no_thinking"] = {
                "content": message.content, "reasoning_content": getattr(message, "reasoning_content", None)}
        return out
    return run


def stream(provider: str):
    def run(args: Any) -> dict[str, Any]:
        chunks = list(_call(args, provider, stream=True, extra_body=thinking(True)))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        return {"chunks": len(chunks), "content": "".join(d.content or "" for d in deltas),
                "reasoning_content": reasoning,
                "finish_reason": next((c.choices[0].finish_reason for c in reversed(chunks)
                                       if c.choices and c.choices[0].finish_reason), None)}
    return run


def tool_call(provider: str):
    def run(args: Any) -> dict[str, Any]:
        response = _call(args, provider, tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER,
                         extra_body=thinking(False))
        calls = response.choices[0].message.tool_calls or []
        return {"tool_calls": [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                               for c in calls], "finish_reason": response.choices[0].finish_reason}
    return run


if __name__ == "__main__":
    scenarios = {}
    for provider in ("hosted_vllm", "openai"):
        scenarios |= {f"{provider}_plain": plain(provider), f"{provider}_stream": stream(provider),
                      f"{provider}_tool_call": tool_call(provider)}
    run_all(scenarios, {name: md.version(name) for name in ("litellm", "openai")})
