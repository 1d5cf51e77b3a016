"""The coordinator's pool choice pays for a precise token count only where it can change the pool: a long prompt's
coarse estimate decides alone far from every pool's limit; near one, the full sample first, then (if still near)
the pool's /tokenize."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.app import build_app
from policies.config import GatewayConfig

pytestmark = pytest.mark.asyncio

CONFIG = {"model": "MiniMaxAI/MiniMax-M3",
          "pools": [{"name": "interactive", "max_model_len": 32768, "endpoints": ["http://127.0.0.1:9"]},
                    {"name": "repository", "max_model_len": 131072, "endpoints": ["http://127.0.0.1:9"]}]}
WORDS = "the gateway estimates a long prompt from evenly spaced windows of its text 42 times".split()


def _body(tokens: int) -> dict[str, Any]:
    words = (WORDS[i % len(WORDS)] for i in range(tokens))  # ~1 tiktoken token per word
    return {"messages": [{"role": "user", "content": " ".join(words)}], "max_tokens": 100}


async def _choose(tokens: int) -> tuple[str, list[bool], int, Any]:
    """The pool chosen for a prompt of about `tokens` tokens, the `precise` flag of each classification, and how
    many times a replica was asked to count."""
    app = build_app(GatewayConfig.model_validate(CONFIG))
    coordinator = app.state.coordinator
    classified: list[bool] = []
    counted: list[int] = []
    real = coordinator.classify

    async def spy(body: dict[str, Any], api: str, body_size: int, precise: bool = False) -> Any:
        classified.append(precise)
        return await real(body, api, body_size, precise)

    async def no_replica(pool: Any, body: dict[str, Any], api: str) -> int | None:
        counted.append(1)
        return None

    coordinator.classify, coordinator.exact_prompt_tokens = spy, no_replica
    body = _body(tokens)
    profile = await coordinator.classify(body, "chat", 100)
    choice, fitted, estimated = await coordinator.choose_pool(profile, body, "chat", None, 100)
    return choice.pool.name, classified, len(counted), (profile, fitted, estimated)


async def test_far_from_every_limit_the_coarse_estimate_decides_alone() -> None:
    pool, classified, counted, (profile, fitted, estimated) = await _choose(20_000)
    assert pool == "interactive" and classified == [False] and counted == 0
    assert profile.estimate_refinable and fitted.estimate_refinable and estimated == profile.prompt_tokens
    pool, classified, counted, _ = await _choose(80_000)
    assert pool == "repository" and classified == [False] and counted == 0


async def test_near_a_limit_the_full_sample_then_the_replica_counts() -> None:
    pool, classified, counted, (profile, fitted, estimated) = await _choose(31_000)  # within the band of 32K
    assert classified == [False, True]  # the full sample, then still near: the pool's /tokenize (none here)
    assert counted == 1
    assert not fitted.estimate_refinable and fitted.estimate_error < profile.estimate_error
    assert estimated == fitted.prompt_tokens  # the gateway's own estimate the choice rests on: the precise one
