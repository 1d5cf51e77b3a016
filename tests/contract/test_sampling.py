"""Sampling parameters: `n` choices, logprobs, and SamplingParams' 400s word for word.

vLLM runs each of `n` samples as its own engine request and numbers the choices by `index`; logprobs come back in
the OpenAI shapes (chat: `content` entries with `top_logprobs`; completions: parallel lists). The numbers differ
between backends (the real model has random weights), so only shapes, counts and consistency are asserted.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.contract.support import SERVED_MODEL, Backend, post_stream, random_token_ids, unique_words

MAX_TOKENS = 3


def chat_body(**extra: object) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": unique_words(8)}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "chat_template_kwargs": {"thinking_mode": "disabled"},
        **extra,
    }


def completion_body(**extra: object) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "prompt": unique_words(8), "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}


def bad_request(message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


# ---------------------------------------------------------------------------------------------------------------
# n > 1


async def test_chat_n_returns_one_choice_per_sample(client: httpx.AsyncClient) -> None:
    result = (await client.post("/v1/chat/completions", json=chat_body(n=2))).json()
    assert [c["index"] for c in result["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" and c["message"]["role"] == "assistant" for c in result["choices"])
    usage = result["usage"]
    assert usage["completion_tokens"] == 2 * MAX_TOKENS, "completion tokens add up over the choices"
    assert usage["total_tokens"] == usage["prompt_tokens"] + 2 * MAX_TOKENS


async def test_chat_n_streams_role_chunks_then_each_choice(client: httpx.AsyncClient) -> None:
    body = chat_body(n=2, stream=True, stream_options={"include_usage": True})
    chunks = (await post_stream(client, "/v1/chat/completions", body)).chunks()
    first, second = chunks[0]["choices"], chunks[1]["choices"]
    assert first == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}]  # fmt: skip
    assert second == [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}]  # fmt: skip
    finishes = [c["choices"][0]["index"] for c in chunks[2:-1] if c["choices"][0]["finish_reason"] == "length"]
    assert sorted(finishes) == [0, 1], "each choice finishes once"
    assert all(len(c["choices"]) == 1 for c in chunks[:-1]), "one choice per chunk"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 2 * MAX_TOKENS


async def test_completions_n_non_streaming_and_streaming(client: httpx.AsyncClient) -> None:
    result = (await client.post("/v1/completions", json=completion_body(n=2))).json()
    assert [c["index"] for c in result["choices"]] == [0, 1]
    assert result["usage"]["completion_tokens"] == 2 * MAX_TOKENS

    body = completion_body(n=2, stream=True, stream_options={"include_usage": True})
    chunks = (await post_stream(client, "/v1/completions", body)).chunks()
    *text_chunks, usage_chunk = chunks
    per_index: dict[int, int] = {}
    for chunk in text_chunks:
        [choice] = chunk["choices"]
        per_index[choice["index"]] = per_index.get(choice["index"], 0) + (choice["finish_reason"] == "length")
    assert per_index == {0: 1, 1: 1}
    assert usage_chunk["usage"]["completion_tokens"] == 2 * MAX_TOKENS


# ---------------------------------------------------------------------------------------------------------------
# logprobs


def assert_chat_logprob_entries(entries: list[dict[str, Any]], top: int) -> None:
    for entry in entries:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(entry["token"], str) and entry["logprob"] <= 0
        assert entry["bytes"] == list(entry["token"].encode("utf-8", "replace"))
        assert len(entry["top_logprobs"]) == top
        for alt in entry["top_logprobs"]:
            assert set(alt) == {"token", "logprob", "bytes"}
        if top:
            assert entry["top_logprobs"][0] == {k: entry[k] for k in ("token", "logprob", "bytes")}, "sampled first"


@pytest.mark.parametrize("top", [0, 2])
async def test_chat_logprobs_object(client: httpx.AsyncClient, top: int) -> None:
    result = (await client.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=top))).json()
    logprobs = result["choices"][0]["logprobs"]
    assert set(logprobs) == {"content"}
    assert len(logprobs["content"]) == MAX_TOKENS
    assert_chat_logprob_entries(logprobs["content"], top)
    plain = (await client.post("/v1/chat/completions", json=chat_body())).json()
    assert plain["choices"][0]["logprobs"] is None


async def test_chat_logprobs_stream_cover_every_token(client: httpx.AsyncClient) -> None:
    body = chat_body(logprobs=True, top_logprobs=1, stream=True)
    chunks = (await post_stream(client, "/v1/chat/completions", body)).chunks()
    assert chunks[0]["choices"][0]["logprobs"] is None, "the role chunk has none"
    entries = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == MAX_TOKENS
    assert_chat_logprob_entries(entries, 1)


async def test_completion_logprobs_lists(client: httpx.AsyncClient) -> None:
    result = (await client.post("/v1/completions", json=completion_body(logprobs=2))).json()
    logprobs = result["choices"][0]["logprobs"]
    assert set(logprobs) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    tokens = logprobs["tokens"]
    assert len(tokens) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == MAX_TOKENS
    offsets = [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    for token, top in zip(tokens, logprobs["top_logprobs"], strict=True):
        assert token in top and 1 <= len(top) <= 3, "the sampled token plus up to `logprobs` others"

    body = completion_body(logprobs=0, stream=True)
    chunks = (await post_stream(client, "/v1/completions", body)).chunks()
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert sum(len(lp["tokens"]) for lp in streamed) == MAX_TOKENS
    assert all(len(top) == 1 for lp in streamed for top in lp["top_logprobs"])
    assert streamed[0]["text_offset"] == [0]
    assert streamed[1]["text_offset"] == [len(streamed[0]["tokens"][0])], "offsets continue across chunks"


# ---------------------------------------------------------------------------------------------------------------
# SamplingParams' checks (after the prompt checks) and the request validators' (before anything else)

SAMPLING_ERRORS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"temperature": -1}, bad_request(
        "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)", "temperature")),
    ({"temperature": 3}, bad_request(
        "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)", "temperature")),
    ({"top_p": 0}, bad_request("top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", "top_p")),
    ({"top_p": 1.5}, bad_request("top_p must be in (0, 1], got 1.5. (parameter=top_p, value=1.5)", "top_p")),
    ({"top_k": -2}, bad_request("top_k must be 0 (disable), or at least 1, got -2.")),
    ({"min_p": 2}, bad_request("min_p must be in [0, 1], got 2.0.")),
    ({"presence_penalty": 3}, bad_request("presence_penalty must be in [-2, 2], got 3.0.")),
    ({"frequency_penalty": -3}, bad_request("frequency_penalty must be in [-2, 2], got -3.0.")),
    ({"repetition_penalty": 0}, bad_request("repetition_penalty must be greater than zero, got 0.0.")),
    ({"n": 0}, bad_request("n must be at least 1, got 0.")),
    ({"n": 2, "temperature": 0}, bad_request("n must be 1 when using greedy sampling, got 2.")),
    ({"max_tokens": 0}, bad_request(
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens")),
    ({"max_tokens": -1}, bad_request(
        "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)", "max_tokens")),
    ({"min_tokens": -1}, bad_request("min_tokens must be greater than or equal to 0, got -1.")),
    ({"min_tokens": 50}, bad_request(f"min_tokens must be less than or equal to max_tokens={MAX_TOKENS}, got 50.")),
    ({"stop": ""}, bad_request("stop cannot contain an empty string.")),
]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("extra", "expected"), SAMPLING_ERRORS, ids=[str(e[0]) for e in SAMPLING_ERRORS])
async def test_sampling_parameter_errors(
    client: httpx.AsyncClient, path: str, extra: dict[str, Any], expected: dict[str, Any]
) -> None:
    body = chat_body(**extra) if path == "/v1/chat/completions" else completion_body(**extra)
    response = await client.post(path, json=body)
    assert response.status_code == 400
    assert response.json() == expected


CHAT_ONLY_ERRORS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"max_completion_tokens": 0}, bad_request(
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens")),
    ({"top_logprobs": 3}, bad_request(
        "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)", "top_logprobs")),
    ({"logprobs": True, "top_logprobs": -2}, bad_request(
        "`top_logprobs` must be a positive value or -1. (parameter=top_logprobs, value=-2)", "top_logprobs")),
    ({"logprobs": True, "top_logprobs": 30}, bad_request(
        "Requested sample logprobs of 30, which is greater than max allowed: 20 (parameter=logprobs, value=30)",
        "logprobs")),
    ({"tools": []}, bad_request(
        "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely. "
        "(parameter=tools)", "tools")),
    ({"tool_choice": "auto"}, bad_request(
        "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)", "tool_choice")),
    ({"cache_salt": ""}, bad_request(
        "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)", "cache_salt")),
    ({"cache_salt": "a/b"}, bad_request(
        "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL. "
        "(parameter=cache_salt)", "cache_salt")),
    # The validators run last-defined first: the generation-prompt check beats stream_options.
    ({"stream_options": {"include_usage": True}, "add_generation_prompt": True, "continue_final_message": True},
     bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")),
    # Left at its default, add_generation_prompt meets continue_final_message only in the chat template.
    ({"continue_final_message": True}, bad_request(
        "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when you "
        "want the model to continue the final message, and add_generation_prompt when you want to add a header that "
        "will prompt it to start a new assistant message instead.")),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "expected"), CHAT_ONLY_ERRORS, ids=[str(e[0]) for e in CHAT_ONLY_ERRORS])
async def test_chat_request_errors(client: httpx.AsyncClient, extra: dict[str, Any], expected: dict[str, Any]) -> None:
    response = await client.post("/v1/chat/completions", json=chat_body(**extra))
    assert response.status_code == 400
    assert response.json() == expected


COMPLETION_ONLY_ERRORS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"logprobs": -2}, bad_request(
        "`logprobs` must be a positive value or -1. (parameter=logprobs, value=-2)", "logprobs")),
    ({"logprobs": 30}, bad_request(
        "Requested sample logprobs of 30, which is greater than max allowed: 20 (parameter=logprobs, value=30)",
        "logprobs")),
    ({"prompt": ""}, bad_request(
        "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt")),
    ({"prompt": []}, bad_request("You must pass at least one prompt")),
    ({"prompt": "", "stream_options": {"include_usage": True}}, bad_request(
        "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt")),
    ({"logprobs": -3, "stream_options": {"include_usage": True}}, bad_request(
        "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "stream_options")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "expected"), COMPLETION_ONLY_ERRORS, ids=[str(e[0]) for e in COMPLETION_ONLY_ERRORS]
)
async def test_completion_request_errors(
    client: httpx.AsyncClient, extra: dict[str, Any], expected: dict[str, Any]
) -> None:
    response = await client.post("/v1/completions", json=completion_body(**extra))
    assert response.status_code == 400
    assert response.json() == expected


async def test_prompt_checks_come_before_sampling_checks(client: httpx.AsyncClient, backend: Backend) -> None:
    limit = backend.max_model_len
    too_long = {"model": SERVED_MODEL, "prompt": random_token_ids(limit + 1), "max_tokens": 1, "temperature": -1}
    assert (await client.post("/v1/completions", json=too_long)).json()["error"]["param"] == "input_tokens"
    # ... and max_tokens above max_model_len is refused before the messages are even rendered.
    body = {"model": SERVED_MODEL, "messages": [], "max_tokens": limit + 1, "temperature": -1}
    assert (await client.post("/v1/chat/completions", json=body)).json()["error"]["param"] == "max_tokens"
    named = {"model": SERVED_MODEL, "messages": [], "max_completion_tokens": limit + 1}
    assert (await client.post("/v1/chat/completions", json=named)).json() == bad_request(
        f"max_completion_tokens={limit + 1} cannot be greater than max_model_len={limit}. Please request fewer "
        f"output tokens. (parameter=max_completion_tokens, value={limit + 1})",
        "max_completion_tokens",
    )
