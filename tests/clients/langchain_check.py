"""LangChain's `ChatOpenAI` against the gateway: invoke, stream, `bind_tools` with a forced call and the tool's result
sent back, and `with_structured_output` both ways (function calling and a json_schema response_format). Prints what
LangChain returned as JSON (tests/clients/_check.py)."""

from __future__ import annotations

import importlib.metadata as md
from enum import Enum
from typing import Any

from _check import run_all, thinking
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Colour(str, Enum):
    RED = "red"
    BLUE = "blue"


class Person(BaseModel):
    """A person."""

    name: str = Field(min_length=2, max_length=20)
    age: int = Field(ge=0, le=120)
    colour: Colour


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 21 C."


def _llm(args: Any, think: bool = False, **kwargs: Any) -> ChatOpenAI:
    return ChatOpenAI(base_url=args.base_url, api_key="not-used", model=args.model, max_retries=0, timeout=60,
                      max_tokens=300, extra_body=thinking(think), **kwargs)


def invoke(args: Any) -> dict[str, Any]:
    message = _llm(args, think=True).invoke("Say hello.")
    return {"content": message.content, "additional_kwargs": sorted(message.additional_kwargs),
            "finish_reason": message.response_metadata.get("finish_reason"),
            "usage": dict(message.usage_metadata or {})}


def stream(args: Any) -> dict[str, Any]:
    chunks = list(_llm(args, stream_usage=True).stream("Say hello."))
    text = "".join(c.content for c in chunks if isinstance(c.content, str))
    usage = next((dict(c.usage_metadata) for c in chunks if c.usage_metadata), {})
    return {"chunks": len(chunks), "content": text, "usage": usage}


def tools(args: Any) -> dict[str, Any]:
    llm = _llm(args).bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    asked = llm.invoke([question])
    calls = [{"name": c["name"], "args": c["args"], "id": c["id"]} for c in asked.tool_calls]
    results = [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in asked.tool_calls]
    final = _llm(args).bind_tools([get_weather]).invoke([question, asked, *results])
    return {"tool_calls": calls, "tool_results": [r.content for r in results], "final_content": final.content,
            "final_tool_calls": len(final.tool_calls)}


def structured(method: str):
    def run(args: Any) -> dict[str, Any]:
        chain = _llm(args).with_structured_output(Person, method=method, include_raw=True)
        out = chain.invoke("Describe a person.")
        parsed = out["parsed"]
        return {"type": type(parsed).__name__, "parsed": parsed.model_dump(mode="json") if parsed else None,
                "parsing_error": str(out["parsing_error"]) if out["parsing_error"] else None,
                "raw_content": out["raw"].content, "raw_tool_calls": len(out["raw"].tool_calls)}
    return run


if __name__ == "__main__":
    run_all({"invoke": invoke, "stream": stream, "bind_tools": tools,
             "structured_function_calling": structured("function_calling"),
             "structured_json_schema": structured("json_schema")},
            {name: md.version(name) for name in ("langchain-openai", "langchain-core", "openai")})
