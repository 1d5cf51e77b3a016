"""Three simulated pools (32K with images, 128K, 1M) behind one real gateway process; the OpenAI SDK as client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
SIM_SPEED = ["--speed", "50"]


def gateway_config(sims: dict[str, list[SimProcess]], **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model": MODEL,
        "aliases": ["minimax-m3"],
        "pools": [
            {"name": "interactive", "max_model_len": 32768, "modalities": ["text", "image", "video"],
             "endpoints": [s.url for s in sims["interactive"]]},
            {"name": "repository", "max_model_len": 131072, "modalities": ["text"],
             "endpoints": [s.url for s in sims["repository"]]},
            {"name": "extended", "max_model_len": 1048576, "modalities": ["text"],
             "endpoints": [s.url for s in sims["extended"]]},
        ],
        "server": {"health_interval_s": 0.5, "max_body_bytes": 8 * 1024 * 1024},
    }
    config.update(overrides)
    return config


@pytest.fixture(scope="session")
def sims() -> Iterator[dict[str, list[SimProcess]]]:
    specs = [
        {"max_model_len": 32768, "extra_args": [*SIM_SPEED, "--modalities", "text,image,video"]},
        {"max_model_len": 32768, "extra_args": [*SIM_SPEED, "--modalities", "text,image,video"]},
        {"max_model_len": 131072, "extra_args": SIM_SPEED},
        {"max_model_len": 1048576, "extra_args": SIM_SPEED},
    ]
    with running_sims(specs) as procs:
        yield {"interactive": procs[0:2], "repository": [procs[2]], "extended": [procs[3]]}


@pytest.fixture(scope="session")
def gateway(sims: dict[str, list[SimProcess]]) -> Iterator[GatewayProcess]:
    gw = start_gateway(gateway_config(sims))
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="session")
def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="client-key-not-forwarded", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def aclient(gateway: GatewayProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)


def sim_stats(sim: SimProcess) -> dict[str, Any]:
    return httpx.get(sim.url + "/sim/stats", timeout=5).json()
