"""The real OpenAI SDK, pointed at m3gate in front of three simulated pools, changes nothing but base_url."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from gateway.cli.launcher import start_gateway
from pools.sim.launcher import SimProcess
from tests.e2e.conftest import MODEL, gateway_config

WORDS = ("alpha beta gamma delta kernel router prefix cache block token stream replica pool latency budget "
         "context window session agent tool result image video thinking mode").split()


def text_of(tokens: int, seed: int = 0) -> str:
    """About `tokens` cl100k tokens of varied words (each common word with its space is one token)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def pool_of(raw: object) -> str:
    return raw.headers["x-m3gate-pool"]  # type: ignore[attr-defined]


def test_non_streaming_chat_reaches_interactive_pool(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8
    )
    completion = raw.parse()
    assert pool_of(raw) == "interactive"
    assert raw.headers["x-m3gate-endpoint"].startswith("http://127.0.0.1:")
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    assert completion.usage.prompt_tokens > 0


def test_alias_is_accepted_and_rewritten(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="minimax-m3", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert completion.model == MODEL


def test_streaming_chat_hides_injected_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Stream please"}], max_tokens=12, stream=True,
            extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks), "the usage chunk m3gate asked for must not reach the client"
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text


def test_streaming_chat_with_usage_and_reasoning(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Think first"}], max_tokens=40, stream=True,
        stream_options={"include_usage": True}, extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}},
    )
    chunks = list(stream)
    reasoning = [getattr(c.choices[0].delta, "reasoning", None) for c in chunks if c.choices]
    assert any(reasoning), "reasoning deltas must pass through unchanged"
    first_reasoning = next(i for i, r in enumerate(reasoning) if r)
    first_content = next((i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content), None)
    if first_content is not None:
        assert first_reasoning < first_content
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert usage_chunks[0].usage.completion_tokens > 0


def test_tool_call_deltas_pass_through(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
        tool_choice="required", max_tokens=64, stream=True,
    ))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert isinstance(json.loads(args), dict)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_completions_non_streaming_and_streaming(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert pool_of(raw) == "interactive"
    assert raw.parse().choices[0].text
    pieces = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices)


def test_over_long_request_is_a_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2_000_000
        )
    err = info.value.body
    assert err["code"] == "context_length_exceeded"  # type: ignore[index]
    assert "1,048,576" in err["message"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "expected_pool"),
    [(200, 64, "interactive"), (60_000, 256, "repository"), (300_000, 256, "extended"), (30_000, 8_000, "repository")],
)
def test_context_length_picks_the_smallest_pool_that_holds_it(
    client: openai.OpenAI, prompt_tokens: int, max_tokens: int, expected_pool: str
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text_of(prompt_tokens)}], max_tokens=max_tokens
    )
    assert pool_of(raw) == expected_pool
    assert raw.parse().usage.prompt_tokens > 0


def test_image_goes_to_a_pool_that_takes_images(sims: dict[str, list[SimProcess]]) -> None:
    """A gateway whose smallest pool takes text only: a router that ignored the image would pick that pool."""
    config = gateway_config(sims)
    config["pools"].insert(0, {"name": "short", "max_model_len": 16384, "modalities": ["text"],
                               "endpoints": [s.url for s in sims["repository"]]})
    gw = start_gateway(config)
    try:
        client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=60)
        text = client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "What is in this picture?"}],
        )
        assert pool_of(text) == "short", "the same request without its image goes to the smallest pool"
        image = client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=8,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}},
            ]}],
        )
        assert pool_of(image) == "interactive"
    finally:
        gw.stop()


def test_forced_pool_header(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_headers={"x-m3gate-pool": "extended"},
    )
    assert pool_of(raw) == "extended"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text_of(60_000)}], max_tokens=64,
            extra_headers={"x-m3gate-pool": "interactive"},
        )


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_models_health_ready_tokenize(gateway) -> None:  # type: ignore[no-untyped-def]
    models = httpx.get(gateway.base_url + "/models").json()
    assert {m["id"] for m in models["data"]} == {MODEL, "minimax-m3"}
    assert all(m["max_model_len"] == 1048576 for m in models["data"])
    assert httpx.get(gateway.url + "/health").status_code == 200
    ready = httpx.get(gateway.url + "/ready")
    assert ready.status_code == 200 and all(ready.json()["pools"].values())
    tok = httpx.post(gateway.url + "/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert tok.status_code == 200 and tok.json()["count"] > 0


BAD_BODIES = [
    (b"{not json", 400),
    (b"[1, 2, 3]", 400),
    (b"", 400),
    (json.dumps({"model": MODEL, "messages": "hello"}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": []}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"content": "no role"}]}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}).encode(), 400),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(), 400),
    (json.dumps({"model": 42, "messages": [{"role": "user", "content": "x"}]}).encode(), 400),
    (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(), 404),
    (b"[" * 5000 + b"]" * 5000, 400),
]


@pytest.mark.parametrize(("body", "status"), BAD_BODIES)
def test_bad_input_gets_openai_shaped_4xx(gateway, body: bytes, status: int) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(gateway.base_url + "/chat/completions", content=body,
                      headers={"content-type": "application/json"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]


def test_oversized_body_is_413_and_gateway_keeps_serving(gateway, client: openai.OpenAI) -> None:  # type: ignore[no-untyped-def]
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (9 * 1024 * 1024)}]})
    resp = httpx.post(gateway.base_url + "/chat/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still up?"}],
                                          max_tokens=2).choices


def test_unknown_path_is_openai_shaped_404(gateway) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.get(gateway.base_url + "/nope")
    assert resp.status_code == 404
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_pool_gets_its_own_key_never_the_clients() -> None:
    """The replica (started with --api-key) accepts only the pool's key from config: the client's is not sent."""
    from gateway.cli.launcher import start_gateway
    from pools.sim.launcher import start_sim

    sim = start_sim(32768, extra_args=["--api-key", "pool-secret", "--instant"])
    try:
        cfg = {"model": MODEL, "pools": [{"name": "only", "max_model_len": 32768, "endpoints": [sim.url],
                                          "api_key": "pool-secret"}]}
        gw = start_gateway(cfg)
        try:
            c = openai.OpenAI(base_url=gw.base_url, api_key="client-secret", max_retries=0)
            assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2).choices
            cfg["pools"][0]["api_key"] = None
        finally:
            gw.stop()
        gw = start_gateway(cfg)  # no pool key: the client's key must not leak through, so the replica says 401
        try:
            c = openai.OpenAI(base_url=gw.base_url, api_key="pool-secret", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        finally:
            gw.stop()
    finally:
        sim.stop()
