"""Error statuses and bodies, word for word: the gateway relays and classifies them, so they must be exact."""

from __future__ import annotations

from typing import Any

import httpx

from tests.contract.support import SERVED_MODEL, Backend, LocalTokenizer, random_token_ids, unique_words


def error(message: str, type_: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def too_long(max_model_len: int, count: int, *, at_least: bool) -> dict[str, Any]:
    qualifier = "at least " if at_least else ""
    return error(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. Please reduce "
        f"the length of the input prompt. (parameter=input_tokens, value={count})",
        "BadRequestError",
        "input_tokens",
        400,
    )


async def test_over_length_chat_prompt(client: httpx.AsyncClient, backend: Backend) -> None:
    """Text is tokenized with truncation at max+1, so the count reads 'at least max+1' however long it was."""
    content = unique_words(backend.max_model_len)  # ~2 tokens per word: well over, under the character bound
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 5}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json() == too_long(backend.max_model_len, backend.max_model_len + 1, at_least=True)


async def test_over_length_completion_text(client: httpx.AsyncClient, backend: Backend) -> None:
    body = {"model": SERVED_MODEL, "prompt": unique_words(backend.max_model_len), "max_tokens": 5}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json() == too_long(backend.max_model_len, backend.max_model_len + 1, at_least=True)


async def test_over_length_token_ids_count_exactly(client: httpx.AsyncClient, backend: Backend) -> None:
    limit = backend.max_model_len
    over = await client.post(
        "/v1/completions", json={"model": SERVED_MODEL, "prompt": random_token_ids(limit + 52), "max_tokens": 1}
    )
    assert over.status_code == 400
    assert over.json() == too_long(limit, limit + 52, at_least=False)
    one_over = await client.post(
        "/v1/completions", json={"model": SERVED_MODEL, "prompt": random_token_ids(limit + 1), "max_tokens": 1}
    )
    assert one_over.json() == too_long(limit, limit + 1, at_least=True)


async def test_prompt_filling_the_context_leaves_no_output(client: httpx.AsyncClient, backend: Backend) -> None:
    """max_tokens is clamped to max_model_len - prompt, and zero output tokens is rejected."""
    body = {"model": SERVED_MODEL, "prompt": random_token_ids(backend.max_model_len), "max_tokens": 1}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json() == error(
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "BadRequestError", "max_tokens", 400
    )


async def test_prompt_plus_max_tokens_over_the_limit_is_clamped(client: httpx.AsyncClient, backend: Backend) -> None:
    body = {"model": SERVED_MODEL, "prompt": random_token_ids(backend.max_model_len - 4), "max_tokens": 100}
    response = await client.post("/v1/completions", json={**body, "ignore_eos": True})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 4


async def test_character_pre_check(client: httpx.AsyncClient, backend: Backend, oracle: LocalTokenizer) -> None:
    """Text longer than max_model_len x the longest vocabulary entry is refused before tokenizing."""
    bound = backend.max_model_len * oracle.max_chars_per_token()
    prompt = "x" * (bound + 100)
    response = await client.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json() == error(
        f"This model's maximum context length is {backend.max_model_len} tokens. However, your prompt contains "
        f"{len(prompt)} characters (more than {bound} characters, which is the upper bound for "
        f"{backend.max_model_len} input tokens). Please reduce the length of the input prompt. "
        f"(parameter=input_text, value={len(prompt)})",
        "BadRequestError",
        "input_text",
        400,
    )


async def test_character_pre_check_counts_the_rendered_chat_prompt(
    client: httpx.AsyncClient, backend: Backend, oracle: LocalTokenizer
) -> None:
    bound = backend.max_model_len * oracle.max_chars_per_token()
    messages = [{"role": "user", "content": "x" * (bound + 1)}]
    # The rendered prompt is what gets measured: recover it from /tokenize (byte-level BPE decodes losslessly).
    rendered = oracle.decode((await client.post("/tokenize", json={"messages": messages})).json()["tokens"])
    body = {"model": SERVED_MODEL, "messages": messages, "max_tokens": 1}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json() == error(
        f"This model's maximum context length is {backend.max_model_len} tokens. However, your prompt contains "
        f"{len(rendered)} characters (more than {bound} characters, which is the upper bound for "
        f"{backend.max_model_len} input tokens). Please reduce the length of the input prompt. "
        f"(parameter=input_text, value={len(rendered)})",
        "BadRequestError",
        "input_text",
        400,
    )
    # /tokenize has no length checks at all.
    assert (await client.post("/tokenize", json={"prompt": "x" * (bound + 1)})).status_code == 200


async def test_max_tokens_above_max_model_len(client: httpx.AsyncClient, backend: Backend) -> None:
    limit = backend.max_model_len
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": limit + 1}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json() == error(
        f"max_tokens={limit + 1} cannot be greater than max_model_len={limit}. Please request fewer output tokens. "
        f"(parameter=max_tokens, value={limit + 1})",
        "BadRequestError",
        "max_tokens",
        400,
    )


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    expected = error(f"The model `nope` does not exist. Valid aliases: {SERVED_MODEL}.", "NotFoundError", "model", 404)
    chat = await client.post(
        "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert chat.status_code == 404 and chat.json() == expected
    completion = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert completion.status_code == 404 and completion.json() == expected


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/chat/completions", content=b'{"model": "x", "messages":', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "Bad Request" and err["code"] == 400
    assert err["message"].startswith("1 validation error:\n") and "json_invalid" in err["message"]
    assert err["param"].startswith("body")


async def test_schema_violations_are_400_with_the_field(client: httpx.AsyncClient) -> None:
    missing = await client.post("/v1/chat/completions", json={"model": SERVED_MODEL})
    assert missing.status_code == 400
    assert missing.json()["error"]["type"] == "Bad Request"
    assert missing.json()["error"]["param"] == "body.messages"
    assert "'type': 'missing'" in missing.json()["error"]["message"]

    wrong_type = await client.post(
        "/v1/chat/completions",
        json={"model": SERVED_MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"},
    )
    assert wrong_type.status_code == 400
    assert wrong_type.json()["error"]["param"] == "body.max_tokens"

    not_an_object = await client.post("/v1/chat/completions", json=[1, 2])
    assert not_an_object.status_code == 400
    assert not_an_object.json()["error"]["param"] == "body"


async def test_validation_errors_print_dotted_locations_and_summarised_inputs(client: httpx.AsyncClient) -> None:
    """vLLM's handler rewrites each pydantic error: `loc` dotted, `input` summarised (containers described,
    scalars as strings)."""
    missing = await client.post("/v1/chat/completions", json={"model": SERVED_MODEL})
    assert missing.json() == error(
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', "
        "'input': '<dict of 1 items>'}",
        "Bad Request",
        "body.messages",
        400,
    )
    negative = await client.post("/detokenize", json={"tokens": [5, -1]})
    assert negative.json() == error(
        "1 validation error:\n  {'type': 'greater_than_equal', 'loc': 'body.tokens.1', 'msg': 'Input should be "
        "greater than or equal to 0', 'input': '-1', 'ctx': {'ge': 0}}",
        "Bad Request",
        "body.tokens.1",
        400,
    )
    wrong_type = await client.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": "x", "max_tokens": "many"})
    assert wrong_type.json() == error(
        "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid "
        "integer, unable to parse string as an integer', 'input': 'many'}",
        "Bad Request",
        "body.max_tokens",
        400,
    )


async def test_non_json_content_type_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
    assert response.status_code == 400
    assert response.json() == error(
        "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed", "Bad Request", None, 400
    )


async def test_empty_conversation_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={"model": SERVED_MODEL, "messages": []})
    assert response.status_code == 400
    assert response.json() == error(
        "Cannot apply chat template to an empty conversation. Provide at least one message.",
        "BadRequestError",
        None,
        400,
    )


async def test_image_to_text_only_model_is_400(client: httpx.AsyncClient) -> None:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json() == error(f"{SERVED_MODEL} is not a multimodal model", "BadRequestError", None, 400)
