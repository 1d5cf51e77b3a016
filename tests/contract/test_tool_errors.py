"""A chat request whose tool `function` is not an object: vLLM's pydantic model refuses it with a 400 "Bad Request"
naming each bad tool, before anything is generated. The simulator used to crash on it (a plain 500) whenever its answer
plan called a tool."""

from __future__ import annotations

import httpx

from tests.contract.support import SERVED_MODEL, unique_words

NOT_AN_OBJECT = "'msg': 'Input should be a valid dictionary or object to extract fields from'"


def validation_error(*errors: tuple[int, str]) -> dict[str, object]:
    """The body vLLM sends for these pydantic errors: one (tool index, summarised input) per bad tool."""
    n = len(errors)
    lines = "".join(f"\n  {{'type': 'model_attributes_type', 'loc': 'body.tools.{i}.function', {NOT_AN_OBJECT}, "
                    f"'input': {shown!r}}}" for i, shown in errors)
    return {"error": {"message": f"{n} validation error{'s' if n > 1 else ''}:{lines}", "type": "Bad Request",
                      "param": f"body.tools.{errors[0][0]}.function", "code": 400}}


async def test_a_tool_function_that_is_a_string_is_400(client: httpx.AsyncClient) -> None:
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": unique_words(8)}], "max_tokens": 8,
            "tools": [{"type": "function", "function": "x"}]}
    for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": "required"}):
        response = await client.post("/v1/chat/completions", json={**body, **choice})
        assert response.status_code == 400, choice
        assert response.json() == validation_error((0, "x")), choice


async def test_every_tool_whose_function_is_not_an_object_is_named(client: httpx.AsyncClient) -> None:
    tools = [{"type": "function", "function": None},
             {"type": "function", "function": {"name": "fine", "parameters": {"type": "object"}}},
             {"type": "function", "function": [1, 2]}]
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": unique_words(8)}], "max_tokens": 8,
            "tools": tools, "stream": True}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json() == validation_error((0, "None"), (2, "<list of 2 items>"))
