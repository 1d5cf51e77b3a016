"""Token estimates that heal: simulated replicas tokenize with a small BPE vocabulary (the tiny model's: ~7 of its
tokens per tiktoken token on English prose, ~3 on CJK, ~2 on code), so the gateway's tiktoken estimate puts 12K-33K
token prompts in the 8K pool. A replica's over-length 400 is retried in the 64K pool instead of reaching the client,
and the per-pool estimate ratio, learnt from the answers, stops the bounces after a few requests."""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
WORDS = ("extraordinary circumstances surrounding international negotiations necessitated comprehensive "
         "documentation regarding environmental sustainability responsibilities").split()


@pytest.fixture(scope="module")
def sims(tiny_tokenizer_dir: Path) -> Iterator[list[SimProcess]]:
    args = ["--tokenizer", str(tiny_tokenizer_dir), "--instant", "--mean-output-tokens", "4"]
    with running_sims([{"max_model_len": 8192, "extra_args": args},
                       {"max_model_len": 65536, "extra_args": args}]) as procs:
        yield procs


def _gateway(sims: list[SimProcess]) -> GatewayProcess:
    return start_gateway({
        "model": MODEL,
        "pools": [{"name": "small", "max_model_len": 8192, "endpoints": [sims[0].url]},
                  {"name": "large", "max_model_len": 65536, "endpoints": [sims[1].url]}],
        "server": {"health_interval_s": 0.5},
        "classification": {"output_budget": {"adaptive": 256, "enabled": 256, "disabled": 256}},
    })


@pytest.fixture()
def gateway(sims: list[SimProcess]) -> Iterator[GatewayProcess]:
    gw = _gateway(sims)  # a fresh gateway per test: nothing learnt yet
    try:
        yield gw
    finally:
        gw.stop()


def _prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _metrics(gw: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _bounces(gw: GatewayProcess) -> float:
    return _metrics(gw).get(("m3gate_routing_decisions_total", (("pool", "large"), ("reason", "overlength_retry"))),
                            0.0)


def _chat(client: openai.OpenAI, text: str, **extra: object) -> tuple[int, str, object]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4, **extra)  # type: ignore[call-overload]
    return raw.http_response.status_code, raw.headers["x-m3gate-pool"], raw.parse()


def test_prompts_the_estimate_puts_in_the_small_pool_are_served_by_the_large_one(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", max_retries=0, timeout=60)
    rng = random.Random(3)
    pools = []
    for words in [1000, 1500, 2000, 2500, 1200, 1800, 2200, 2400, 1600, 1400, 2100, 1900]:  # 12K-33K replica tokens
        status, pool, answer = _chat(client, _prose(rng, words))
        assert status == 200 and answer.choices[0].message is not None  # type: ignore[attr-defined]
        pools.append(pool)
        assert answer.usage.prompt_tokens > 8192  # type: ignore[attr-defined]  # really too long for the small pool
    assert pools == ["large"] * len(pools)
    bounces = _bounces(gateway)
    assert 1 <= bounces <= 3, f"{bounces} requests bounced off the small pool; the ratio should stop it after ~2"
    ratio = _metrics(gateway)[("m3gate_token_estimate_ratio", (("pool", "large"),))]
    assert 4.0 <= ratio <= 8.0, ratio  # English prose: ~7 tiny-vocabulary tokens per tiktoken token


def test_code_cjk_and_base64_never_reach_the_client_as_400(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", max_retries=0, timeout=60)
    rng = random.Random(5)
    code = "def checksum(buffer: bytes) -> int:\n    return sum(b for b in buffer) % 65521\n" * 220
    cjk = "人工智能正在改变世界的每一个角落，我们需要认真思考它的影响。" * 300
    blob = base64.b64encode(rng.randbytes(10_000)).decode()
    for text in (code, cjk, blob, code + cjk + blob):
        status, pool, answer = _chat(client, text)
        assert status == 200 and pool == "large"
        assert answer.usage.prompt_tokens > 8192  # type: ignore[attr-defined]
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": cjk}],
                                              max_tokens=4, stream=True)
    assert any(chunk.choices and chunk.choices[0].delta.content for chunk in streamed)


def test_a_forced_pool_and_a_prompt_no_pool_holds_still_get_the_replicas_400(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", max_retries=0, timeout=60)
    rng = random.Random(7)
    with pytest.raises(openai.BadRequestError) as forced:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": _prose(rng, 1500)}],
                                       max_tokens=4, extra_headers={"x-m3gate-pool": "small"})
    assert "maximum context length is 8192" in forced.value.message
    with pytest.raises(openai.BadRequestError) as too_long:  # ~70K replica tokens: more than the large pool holds
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": _prose(rng, 10000)}],
                                       max_tokens=4)
    assert "maximum context length is 65536" in too_long.value.message
    assert (httpx.get(gateway.url + "/health", timeout=5)).status_code == 200
