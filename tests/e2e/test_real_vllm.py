"""The OpenAI SDK through m3gate in front of three REAL vLLM CPU servers (tiny local model): 2K / 4K / 8K tokens
standing in for the 32K / 128K / 1M pools."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from policies.tokens import TokenCounter

pytestmark = pytest.mark.vllm

MODEL = "MiniMaxAI/MiniMax-M3"
WORDS = "the model reads a long file and writes a short patch for the failing test in the repository".split()


def words(n: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def calibration(server_url: str) -> float:
    """What an operator does: compare the model's own count (/tokenize) with m3gate's tiktoken estimate."""
    sample = words(600, seed=99)
    exact = httpx.post(server_url + "/tokenize", json={"model": MODEL, "prompt": sample}, timeout=30).json()["count"]
    return exact / TokenCounter().count(sample)


@pytest.fixture(scope="module")
def real_gateway(vllm_servers: list[Any]) -> Iterator[GatewayProcess]:
    by_len = sorted(vllm_servers, key=lambda s: s.max_model_len)
    names = ["interactive", "repository", "extended"]
    config = {
        "model": MODEL,
        "pools": [{"name": n, "max_model_len": s.max_model_len, "endpoints": [s.url]} for n, s in zip(names, by_len)],
        "classification": {
            "calibration_factor": round(calibration(by_len[0].url), 3),
            "output_budget": {"enabled": 256, "adaptive": 128, "disabled": 64},
        },
        "server": {"health_interval_s": 0.5},
    }
    gw = start_gateway(config)
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def client(real_gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_gateway.base_url, api_key="unused", max_retries=0, timeout=120)


def test_chat_non_streaming_and_streaming(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8
    )
    done = raw.parse()
    assert raw.headers["x-m3gate-pool"] == "interactive"
    assert done.usage.completion_tokens > 0 and done.usage.prompt_tokens > 0

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello again"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason in ("length", "stop")


def test_streaming_without_usage_request_gets_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream"}], max_tokens=6, stream=True,
    ))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_completions(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="def main():", max_tokens=5)
    assert raw.parse().usage.completion_tokens > 0
    pieces = list(client.completions.create(model=MODEL, prompt="import os", max_tokens=5, stream=True))
    assert pieces and pieces[-1].choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(("target_tokens", "pool"), [(3000, "repository"), (6000, "extended")])
def test_longer_prompts_go_to_larger_pools(
    client: openai.OpenAI, vllm_servers: list[Any], target_tokens: int, pool: str
) -> None:
    """Prompt sizes in the model's own tokens (measured with /tokenize), well inside the intended pool."""
    url = vllm_servers[0].url
    per_word = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": words(500)}, timeout=30).json()["count"] / 500
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": words(int(target_tokens / per_word))}], max_tokens=4
    )
    assert raw.headers["x-m3gate-pool"] == pool
    assert raw.parse().usage.prompt_tokens > 0


def test_over_long_request_is_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words(20000)}], max_tokens=4
        )


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = words(900, seed=5)
    usages = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=2).usage for _ in range(2)]
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 128 == 0
