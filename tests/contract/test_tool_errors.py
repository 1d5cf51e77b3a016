"""A chat request whose tool `function` is not an object: vLLM's pydantic model refuses it with a 400 "Bad Request"
naming each bad tool, before anything is generated, whatever `tool_choice` says and before it looks at the model.
The simulator must answer the same 400 whether or not its answer plan calls a tool, and with `tool_choice: "none"`
too. A `tool_choice` naming a function is checked earlier still, by vLLM's own loop over the tools,
which trips over a tool whose `function` is a string: a raw TypeError, which vLLM answers with a 400 carrying its
text; the simulator answers the same."""

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


def _body(tools: object, **fields: object) -> dict[str, object]:
    return {"model": SERVED_MODEL, "messages": [{"role": "user", "content": unique_words(8)}], "max_tokens": 8,
            "tools": tools, **fields}


async def test_a_bad_tool_is_400_even_with_tool_choice_none(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions",
                                 json=_body([{"type": "function", "function": "x"}], tool_choice="none"))
    assert response.status_code == 400
    assert response.json() == validation_error((0, "x"))


async def test_a_bad_tool_is_refused_before_an_unknown_model(client: httpx.AsyncClient) -> None:
    body = {**_body([{"type": "function", "function": "x"}]), "model": "no-such-model"}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json() == validation_error((0, "x"))


NAMED = {"type": "function", "function": {"name": "get_weather"}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


async def test_a_named_tool_choice_over_a_string_function_is_vllms_type_error(client: httpx.AsyncClient) -> None:
    for tools in ([{"type": "function", "function": "x"}], [{"type": "function", "function": "x"}, WEATHER]):
        response = await client.post("/v1/chat/completions", json=_body(tools, tool_choice=NAMED))
        assert response.status_code == 400, tools
        assert response.json() == {"error": {"message": "string indices must be integers, not 'str'",
                                              "type": "BadRequestError", "param": None, "code": 400}}, tools


async def test_a_bad_tool_after_the_named_one_is_left_to_validation(client: httpx.AsyncClient) -> None:
    """vLLM's loop stops at the named tool: a bad tool after it is refused by pydantic instead, like any other."""
    tools = [WEATHER, {"type": "function", "function": "x"}]
    response = await client.post("/v1/chat/completions", json=_body(tools, tool_choice=NAMED))
    assert response.status_code == 400
    assert response.json() == validation_error((1, "x"))


async def test_vllms_tool_loop_fails_as_python_does_on_other_shapes(client: httpx.AsyncClient) -> None:
    """Its handler answers a raw TypeError with a 400 carrying the text, and a KeyError with a 500."""
    cases = [([{"type": "function", "function": None}], 400, "'NoneType' object is not subscriptable"),
             ([{"type": "function", "function": [1]}], 400, "list indices must be integers or slices, not str"),
             (5, 400, "'int' object is not iterable"),
             ([{"type": "function"}], 500, "'function'"),
             ([{"type": "function", "function": {"description": "no name"}}], 500, "'name'")]
    for tools, status, message in cases:
        # vLLM's server closes the connection after answering a 500 (the exception is re-raised to uvicorn once the
        # response is out), so a kept-alive connection can fail the next request: one connection per case.
        response = await client.post("/v1/chat/completions", json=_body(tools, tool_choice=NAMED),
                                     headers={"connection": "close"})
        kind = "BadRequestError" if status == 400 else "InternalServerError"
        assert response.status_code == status, tools
        assert response.json() == {"error": {"message": message, "type": kind, "param": None, "code": status}}, tools
