"""Output-length estimates through a real gateway (OpenAI SDK client, simulated replicas answering 10–30 tokens):
m3gate_output_tokens_prediction_ratio{pool,class} is exported, a session's first turn is estimated from its request
alone (a medium answer: a 512-token prior, far off), and its next turns from its own first answer (near it); pool
choice still holds prompt + max_tokens."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
RATIO = "m3gate_output_tokens_prediction_ratio"
LABELS = (("class", "agents"), ("pool", "main"))


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    args = ["--instant", "--mean-output-tokens", "20"]
    with running_sims([{"max_model_len": 8192, "extra_args": args},
                       {"max_model_len": 32768, "extra_args": args}]) as sims:
        gw = start_gateway({
            "model": MODEL,
            "pools": [{"name": "small", "max_model_len": 8192, "endpoints": [sims[0].url]},
                      {"name": "main", "max_model_len": 32768, "endpoints": [sims[1].url]}],
            "traffic": {"classes": {"agents": {"priority": 0}}, "pool_classes": {"small": "agents", "main": "agents"}},
        })
        try:
            yield gw
        finally:
            gw.stop()


def _buckets(gw: GatewayProcess) -> dict[str, float]:
    """The ratio histogram's cumulative counts by upper bound (and "count"), for the agents class on pool main."""
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            if s.name == RATIO + "_bucket" and labels == LABELS:
                out[s.labels["le"]] = s.value
            elif s.name == RATIO + "_count" and labels == LABELS:
                out["count"] = s.value
    return out


def _turn(gw: GatewayProcess, session: str, n: int, stream: bool) -> dict[str, float]:
    """One turn of `session` (thinking disabled, no tools: a medium prior; max_tokens far above it, and more than
    the small pool holds with the prompt), then the histogram once the turn has been counted."""
    before = _buckets(gw).get("count", 0.0)
    client = openai.OpenAI(base_url=gw.base_url, api_key="k", max_retries=0, timeout=30)
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": f"turn {n} of {session}: go on"}],
              "max_tokens": 16_000, "extra_headers": {"x-session-id": session},
              "extra_body": {"chat_template_kwargs": {"thinking_mode": "disabled"}}}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
        assert chunks and chunks[-1].choices[0].finish_reason == "stop"
    else:
        answer = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        assert answer.usage is not None and answer.usage.completion_tokens <= 30
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = _buckets(gw)
        if now.get("count", 0.0) > before:
            return now
        time.sleep(0.05)
    raise AssertionError(f"the turn was not counted in {RATIO}: {_buckets(gw)}")


def test_the_ratio_is_exported_and_a_session_refines_its_own_estimate(gateway: GatewayProcess) -> None:
    first = _turn(gateway, "alpha", 0, stream=False)
    # 10–30 tokens against the 512-token prior of a medium answer: below a tenth
    assert first["count"] == 1 and first["0.1"] == 1, first
    for n, stream in ((1, True), (2, False), (3, True)):
        later = _turn(gateway, "alpha", n, stream)
        # estimated from the session's own answers (the class has too few yet for the next one to be): within 3×
        assert later["0.1"] == 1 and later["3.0"] - later["0.33"] == n, later
    other = _turn(gateway, "beta", 0, stream=False)
    # another session's first turn: no answers of its own, so the class's (now trusted), not the prior
    assert other["0.1"] == 1 and other["3.0"] - other["0.33"] == 4, other


def test_pool_choice_keeps_the_whole_budget(gateway: GatewayProcess) -> None:
    """The estimate (tens of tokens by now) never sends a request to a pool that cannot hold its max_tokens."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "turn 9 of alpha: go on"}],
            "chat_template_kwargs": {"thinking_mode": "disabled"}}
    for budget, pool in ((16_000, "main"), (100, "small")):
        r = httpx.post(gateway.base_url + "/chat/completions", json={**body, "max_tokens": budget},
                       headers={"x-session-id": "alpha"}, timeout=30)
        assert r.status_code == 200 and r.headers["x-m3gate-pool"] == pool, (budget, r.headers)
