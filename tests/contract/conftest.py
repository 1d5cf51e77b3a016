"""The two backends every contract test runs against: the simulator and a real vLLM server.

Both serve "MiniMaxAI/MiniMax-M3" with --max-model-len 2048 and 128-token blocks over the tiny model's tokenizer,
so every assertion can be the same on both. The vLLM side reuses the session's shared servers (the 2048 one);
tests use prompts no other test sent, and counters are compared as deltas, so sharing does not matter.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from pools.vllm_local.launcher import VllmServer
from tests.contract.support import Backend, LocalTokenizer

CONTRACT_MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def sim_backend(tiny_tokenizer_dir: Path) -> Iterator[Backend]:
    from pools.sim.launcher import start_sim

    sim = start_sim(CONTRACT_MAX_MODEL_LEN, extra_args=["--tokenizer", str(tiny_tokenizer_dir), "--block-size", "128"])
    try:
        yield Backend("sim", sim.url, CONTRACT_MAX_MODEL_LEN, tiny_tokenizer_dir)
    finally:
        sim.stop()


@pytest.fixture(scope="session")
def vllm_backend(vllm_servers: list[VllmServer]) -> Backend:
    server = next((s for s in vllm_servers if s.max_model_len == CONTRACT_MAX_MODEL_LEN), None)
    if server is None:
        pytest.fail(f"no real server with --max-model-len {CONTRACT_MAX_MODEL_LEN} among {vllm_servers}")
    return Backend("vllm", server.url, server.max_model_len, server.model_dir)


@pytest.fixture(params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture
async def client(backend: Backend) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=backend.url, timeout=60.0) as http:
        yield http


@pytest.fixture(scope="session")
def oracle(tiny_tokenizer_dir: Path) -> LocalTokenizer:
    """Token ids straight from tokenizer.json (the sim's and vLLM's tokenizer files are byte-identical)."""
    return LocalTokenizer(tiny_tokenizer_dir)
