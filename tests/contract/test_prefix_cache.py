"""`usage.prompt_tokens_details.cached_tokens`: prefix-cache hits in whole 128-token blocks.

The gateway's prefix-affinity routing is only worth something if this number behaves like vLLM's: zero on first
sight, whole blocks only, never the prompt's last token, and only up to where two prompts diverge.
"""

from __future__ import annotations

import httpx

from tests.contract.support import (
    BLOCK_SIZE,
    SERVED_MODEL,
    expected_cached,
    expected_created,
    post_stream,
    random_token_ids,
    unique_words,
)


async def cached_tokens_of_completion(client: httpx.AsyncClient, prompt: list[int] | str) -> int:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_repeated_chat_prompt_hits_whole_blocks(client: httpx.AsyncClient) -> None:
    body = {
        "model": SERVED_MODEL,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": unique_words(250)}],
        "max_tokens": 2,
    }
    first = (await client.post("/v1/chat/completions", json=body)).json()["usage"]
    second = (await client.post("/v1/chat/completions", json=body)).json()["usage"]
    assert first["prompt_tokens"] == second["prompt_tokens"] > 3 * BLOCK_SIZE
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == expected_cached(second["prompt_tokens"])
    # Chat also reports the tokens this request wrote to the cache: all full blocks the first time, the rest after.
    assert first["prompt_tokens_details"]["created_cache_tokens"] == expected_created(first["prompt_tokens"], 0)
    assert second["prompt_tokens_details"]["created_cache_tokens"] == expected_created(
        second["prompt_tokens"], second["prompt_tokens_details"]["cached_tokens"]
    )


async def test_repeated_streaming_prompt_reports_cached_tokens(client: httpx.AsyncClient) -> None:
    body = {
        "model": SERVED_MODEL, "messages": [{"role": "user", "content": unique_words(200)}], "max_tokens": 2,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    await post_stream(client, "/v1/chat/completions", body)
    usage = (await post_stream(client, "/v1/chat/completions", body)).chunks()[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == expected_cached(usage["prompt_tokens"])


async def test_prompt_of_exact_blocks_recomputes_its_last_block(client: httpx.AsyncClient) -> None:
    prompt = random_token_ids(10 * BLOCK_SIZE)
    assert await cached_tokens_of_completion(client, prompt) == 0
    assert await cached_tokens_of_completion(client, prompt) == 9 * BLOCK_SIZE


async def test_shared_prefix_hits_only_its_whole_blocks(client: httpx.AsyncClient) -> None:
    base = random_token_ids(1000)
    await cached_tokens_of_completion(client, base)
    diverging = base[:700] + random_token_ids(300)
    assert await cached_tokens_of_completion(client, diverging) == expected_cached(1000, shared_prefix=700) == 640
    # A prompt shorter than one block never hits, even when it is a prefix of a cached one.
    assert await cached_tokens_of_completion(client, base[:100]) == 0


async def test_text_prompts_share_blocks_by_token_prefix(client: httpx.AsyncClient) -> None:
    """Byte-level BPE splits at spaces, so the shared text's tokens are a token prefix of both prompts."""
    system = unique_words(300)
    second_prompt = system + " another question entirely"
    assert await cached_tokens_of_completion(client, system + " first question") == 0
    second = await cached_tokens_of_completion(client, second_prompt)
    shared = (await client.post("/tokenize", json={"prompt": system})).json()["count"]
    total = (await client.post("/tokenize", json={"prompt": second_prompt})).json()["count"]
    assert second == expected_cached(total, shared_prefix=shared) >= BLOCK_SIZE
