"""GatewayApp serves the generate paths ahead of Starlette's stack: it must still answer like the rest of the app
(OpenAI-shaped errors, even for the gateway's own bugs; other methods and paths still go through Starlette)."""

from __future__ import annotations

import httpx
import pytest

from gateway.app import build_app
from policies.config import GatewayConfig

pytestmark = pytest.mark.asyncio

CONFIG = {"model": "MiniMaxAI/MiniMax-M3",
          "pools": [{"name": "interactive", "max_model_len": 32768, "endpoints": ["http://127.0.0.1:9"]}]}
CHAT = {"model": "MiniMaxAI/MiniMax-M3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _client(app) -> httpx.AsyncClient:  # type: ignore[no-untyped-def]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def test_a_gateway_bug_on_the_fast_path_is_an_openai_500_and_the_next_request_is_served() -> None:
    app = build_app(GatewayConfig.model_validate(CONFIG))
    coordinator = app.state.coordinator
    real = coordinator.classify

    async def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug")

    coordinator.classify = broken
    async with _client(app) as client:
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}
        assert response.headers["x-m3gate-refusal"] == error["code"] == "internal_error"
        coordinator.classify = real
        bad = await client.post("/v1/chat/completions", content=b"{not json")  # still parsed and answered
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


async def test_other_methods_and_paths_still_go_through_starlette() -> None:
    app = build_app(GatewayConfig.model_validate(CONFIG))
    async with _client(app) as client:
        wrong_method = await client.get("/v1/chat/completions")
        assert wrong_method.status_code == 405 and "error" in wrong_method.json()
        unknown = await client.post("/v1/nothing", json={})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        assert (await client.get("/health")).json() == {"status": "ok"}
