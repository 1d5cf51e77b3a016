"""Chat and completions: SSE framing, chunk shapes, non-streaming shapes, usage and request ids.

Generated text is never asserted (the real model has random weights); `ignore_eos` makes the output length exact.
"""

from __future__ import annotations

import json

import httpx

from tests.contract.support import SERVED_MODEL, VLLM_VERSION, expected_created, post_stream, unique_words

MAX_TOKENS = 6


def chat_body(text: str, **extra: object) -> dict[str, object]:
    return {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "chat_template_kwargs": {"thinking_mode": "disabled"},
        **extra,
    }


async def chat_prompt_tokens(client: httpx.AsyncClient, body: dict[str, object]) -> int:
    keys = ("messages", "chat_template_kwargs")
    response = await client.post("/tokenize", json={k: body[k] for k in keys if k in body})
    return int(response.json()["count"])


def assert_usage_adds_up(usage: dict[str, object], prompt_tokens: int) -> None:
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == prompt_tokens + MAX_TOKENS


async def test_chat_stream_framing_and_chunks(client: httpx.AsyncClient) -> None:
    body = chat_body(unique_words(60), stream=True, stream_options={"include_usage": True})
    prompt_tokens = await chat_prompt_tokens(client, body)
    stream = await post_stream(client, "/v1/chat/completions", body)
    assert stream.status == 200
    assert stream.content_type.startswith("text/event-stream")
    chunks = stream.chunks()

    ids = {chunk["id"] for chunk in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == SERVED_MODEL
        assert isinstance(chunk["created"], int)

    role, *middle, final, usage_chunk = chunks
    assert set(role) == {"id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"}
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    for chunk in middle:
        assert set(chunk) == {"id", "object", "created", "model", "choices"}
        [choice] = chunk["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason", "token_ids"}
        assert choice["finish_reason"] is None
        assert set(choice["delta"]) in ({"content"}, {"content", "reasoning"}), choice["delta"]

    assert set(final) == {"id", "object", "created", "model", "choices"}, "no system_fingerprint when usage follows"
    [last_choice] = final["choices"]
    assert set(last_choice) == {"index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"}
    assert last_choice["finish_reason"] == "length"
    assert last_choice["stop_reason"] is None

    assert set(usage_chunk) == {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
    assert usage_chunk["choices"] == []
    assert usage_chunk["system_fingerprint"].startswith(f"vllm-{VLLM_VERSION}-")
    usage = usage_chunk["usage"]
    assert set(usage) == {
        "prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details", "completion_tokens_details",
    }  # fmt: skip
    assert_usage_adds_up(usage, prompt_tokens)
    created = expected_created(prompt_tokens, 0)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": created}
    assert set(usage["completion_tokens_details"]) == {"reasoning_tokens"}


async def test_chat_stream_without_usage(client: httpx.AsyncClient) -> None:
    stream = await post_stream(client, "/v1/chat/completions", chat_body(unique_words(10), stream=True))
    chunks = stream.chunks()
    assert all(chunk["choices"] for chunk in chunks), "no usage chunk unless include_usage"
    assert all("usage" not in chunk for chunk in chunks)
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["system_fingerprint"].startswith(f"vllm-{VLLM_VERSION}-")


async def test_completions_stream(client: httpx.AsyncClient) -> None:
    prompt = unique_words(25)
    body = {
        "model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    prompt_tokens = (await client.post("/tokenize", json={"prompt": prompt})).json()["count"]
    chunks = (await post_stream(client, "/v1/completions", body)).chunks()
    *text_chunks, usage_chunk = chunks
    assert text_chunks, "at least one text chunk"
    for chunk in text_chunks:
        assert chunk["id"].startswith("cmpl-") and chunk["object"] == "text_completion"
        [choice] = chunk["choices"]
        assert set(choice) == {
            "index",
            "text",
            "logprobs",
            "finish_reason",
            "stop_reason",
            "prompt_token_ids",
            "token_ids",
        }
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert usage_chunk["choices"] == []
    assert_usage_adds_up(usage_chunk["usage"], prompt_tokens)
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_chat_non_streaming_shape(client: httpx.AsyncClient) -> None:
    body = chat_body(unique_words(20))
    prompt_tokens = await chat_prompt_tokens(client, body)
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    result = response.json()
    assert set(result) == {
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
        "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics",
    }  # fmt: skip
    assert result["id"].startswith("chatcmpl-")
    assert result["object"] == "chat.completion"
    assert result["model"] == SERVED_MODEL
    assert result["system_fingerprint"].startswith(f"vllm-{VLLM_VERSION}-")
    [choice] = result["choices"]
    assert set(choice) == {
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "routed_experts",
    }
    assert choice["finish_reason"] == "length"
    message = choice["message"]
    assert set(message) == {"role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"}
    assert message["role"] == "assistant"
    usage = result["usage"]
    assert_usage_adds_up(usage, prompt_tokens)
    assert usage["prompt_tokens_details"] == {
        "cached_tokens": 0, "created_cache_tokens": expected_created(prompt_tokens, 0), "multimodal_tokens": None,
    }  # fmt: skip
    assert set(usage["completion_tokens_details"]) == {"reasoning_tokens"}


async def test_completions_non_streaming_shape(client: httpx.AsyncClient) -> None:
    prompt = unique_words(15)
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    result = (await client.post("/v1/completions", json=body)).json()
    assert set(result) == {
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
        "kv_transfer_params", "ec_transfer_params", "metrics",
    }  # fmt: skip
    assert result["id"].startswith("cmpl-") and result["object"] == "text_completion"
    [choice] = result["choices"]
    assert set(choice) == {
        "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
        "prompt_token_ids", "routed_experts",
    }  # fmt: skip
    assert choice["finish_reason"] == "length"
    prompt_tokens = (await client.post("/tokenize", json={"prompt": prompt})).json()["count"]
    assert_usage_adds_up(result["usage"], prompt_tokens)
    assert result["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None,
    }  # fmt: skip
    assert result["usage"]["completion_tokens_details"] is None


async def test_request_id_header_and_body_name_the_response(client: httpx.AsyncClient) -> None:
    body = chat_body(unique_words(5))
    by_header = await client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "contract-abc"})
    assert by_header.json()["id"] == "chatcmpl-contract-abc"
    by_body = await client.post("/v1/chat/completions", json={**body, "request_id": "contract-def"})
    assert by_body.json()["id"] == "chatcmpl-contract-def"
    completion = await client.post(
        "/v1/completions", json={"model": SERVED_MODEL, "prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "q1"}
    )
    assert completion.json()["id"] == "cmpl-q1"


async def test_stream_options_without_stream_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=chat_body("x", stream_options={"include_usage": True}))
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            "type": "BadRequestError",
            "param": "stream_options",
            "code": 400,
        }
    }


async def test_chat_reads_reasoning_content_as_reasoning(client: httpx.AsyncClient) -> None:
    """The chat request renames the deprecated `reasoning_content` of a message to `reasoning` (rendered by the
    template); /tokenize does not, so only the generate route counts it."""
    question = unique_words(3)

    def messages(**assistant: str) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", **assistant},
            {"role": "user", "content": question},
        ]

    async def prompt_tokens(msgs: list[dict[str, str]]) -> int:
        body = {"model": SERVED_MODEL, "messages": msgs, "max_tokens": 1}
        return int((await client.post("/v1/chat/completions", json=body)).json()["usage"]["prompt_tokens"])

    alias = await prompt_tokens(messages(reasoning_content="thought"))
    assert alias == await prompt_tokens(messages(reasoning="thought")) > await prompt_tokens(messages())
    tokenized = await client.post("/tokenize", json={"messages": messages(reasoning_content="thought")})
    assert tokenized.json()["count"] < alias


async def test_answer_role_follows_the_last_message_without_generation_prompt(client: httpx.AsyncClient) -> None:
    body = {
        "model": SERVED_MODEL, "messages": [{"role": "user", "content": unique_words(4)}], "max_tokens": 1,
        "add_generation_prompt": False,
    }  # fmt: skip
    result = (await client.post("/v1/chat/completions", json=body)).json()
    assert result["choices"][0]["message"]["role"] == "user"


async def test_completions_echo_prefixes_the_prompt(client: httpx.AsyncClient) -> None:
    prompt = unique_words(5)
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "echo": True}
    result = (await client.post("/v1/completions", json=body)).json()
    assert result["choices"][0]["text"].startswith(prompt) and len(result["choices"][0]["text"]) > len(prompt)
    chunks = (await post_stream(client, "/v1/completions", {**body, "stream": True})).chunks()
    assert chunks[0]["choices"][0]["text"].startswith(prompt)
    assert not chunks[1]["choices"][0]["text"].startswith(prompt)


async def test_anthropic_messages_usage_ids_and_errors(client: httpx.AsyncClient) -> None:
    """/v1/messages runs as a chat request: a chatcmpl- id, vLLM's error types in the Anthropic envelope, and
    Anthropic usage where input_tokens excludes cache reads and writes."""
    messages = [{"role": "user", "content": unique_words(200)}]
    prompt_tokens = await chat_prompt_tokens(client, {"messages": messages})
    body = {"model": SERVED_MODEL, "messages": messages, "max_tokens": 2}
    result = (await client.post("/v1/messages", json=body)).json()
    assert result["id"].startswith("chatcmpl-")
    assert set(result) == {"id", "type", "role", "content", "model", "stop_reason", "usage"}, "dumped without nulls"
    created = expected_created(prompt_tokens, 0)
    assert result["usage"] == {
        "input_tokens": prompt_tokens - created, "output_tokens": 2, "cache_creation_input_tokens": created,
        "cache_read_input_tokens": 0,
    }  # fmt: skip

    async with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        raw = (await response.aread()).decode()
    events = {}
    for block in raw.strip().split("\n\n"):
        kind, data = block.split("\n", 1)
        events.setdefault(kind.removeprefix("event: "), json.loads(data.removeprefix("data: ")))
    start = events["message_start"]["message"]
    assert set(start) == {"id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"}
    assert start["usage"] == {"input_tokens": prompt_tokens, "output_tokens": 0}
    assert set(events["message_delta"]["usage"]) == {
        "input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
    }  # fmt: skip

    missing = await client.post("/v1/messages", json={**body, "model": "nope"})
    assert missing.status_code == 404
    assert missing.json() == {"type": "error", "error": {
        "type": "NotFoundError", "message": f"The model `nope` does not exist. Valid aliases: {SERVED_MODEL}."}}
    invalid = await client.post("/v1/messages", json={"model": SERVED_MODEL, "messages": messages})
    assert invalid.status_code == 400 and invalid.json()["error"]["type"] == "Bad Request", "validation: OpenAI shape"
