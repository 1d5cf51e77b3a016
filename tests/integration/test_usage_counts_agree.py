"""Every metric that counts an answer's tokens reads its usage the same way (policies/vllm_wire.usage_counts): on the
Anthropic Messages API, whose `input_tokens` exclude cache reads, the request metrics and the session-turn metrics
agree on the prompt and its cached part."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
LABELS = {"pool": "interactive", "class": "interactive"}


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--instant", "--mean-output-tokens", "8"]}]) as procs:
        yield procs[0]


@pytest.fixture(scope="module")
def gateway(sim: SimProcess) -> Iterator[GatewayProcess]:
    gw = start_gateway({"model": MODEL, "pools": [{"name": "interactive", "max_model_len": 8192,
                                                   "endpoints": [sim.url]}]})
    try:
        yield gw
    finally:
        gw.stop()


def _total(gw: GatewayProcess, name: str) -> float:
    """The sum of a counter's samples with the pool and class labels (over its other labels)."""
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in LABELS.items()))


def test_prompt_tokens_agree_between_request_and_turn_metrics_on_messages(gateway: GatewayProcess) -> None:
    system = "You are a careful assistant. " * 200  # several blocks: the second turn reads them from the cache
    answers = []
    for question in ("What is a prefix cache?", "And a KV cache?"):
        resp = httpx.post(gateway.base_url + "/messages", timeout=30, headers={"x-session-id": "agree-1"},
                          json={"model": MODEL, "max_tokens": 16, "system": system,
                                "messages": [{"role": "user", "content": question}]})
        assert resp.status_code == 200
        answers.append(resp.json()["usage"])
    read = sum(u["cache_read_input_tokens"] for u in answers)
    assert read > 0, "the second turn should have been served from the prefix cache"
    whole = sum(u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] for u in answers)
    assert _total(gateway, "m3gate_prompt_tokens_total") == whole  # cache reads are prompt tokens too
    assert _total(gateway, "m3gate_turn_prompt_tokens_total") == whole
    assert _total(gateway, "m3gate_cached_prompt_tokens_total") == read
    assert _total(gateway, "m3gate_turn_cached_prompt_tokens_total") == read
