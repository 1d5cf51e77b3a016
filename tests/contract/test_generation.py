"""Chat and completions: SSE framing, chunk shapes, non-streaming shapes, usage and request ids.

Generated text is never asserted (the real model has random weights); `ignore_eos` makes the output length exact.
"""

from __future__ import annotations

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
