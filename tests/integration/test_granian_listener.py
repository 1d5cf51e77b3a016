"""`server.listener: granian` (opt-in; uvicorn is the default, docs/performance.md says why): the gateway serves
plain and streamed chats under granian and stops cleanly on SIGTERM. The relay resilience suite passes under it too
(`M3GATE_LISTENER=granian pytest tests/integration/test_relay_resilience.py`); the fuzz suite's slowloris-headers 408
and OpenAI-shaped 400 for malformed requests do not (hyper's own answers), which is why it is not the default."""

from __future__ import annotations

import granian  # noqa: F401 - in the test extra: a missing or broken install fails here, it never skips
import httpx

from gateway.cli.launcher import start_gateway
from pools.sim.launcher import running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5, "ignore_eos": True}


def test_the_gateway_serves_and_stops_under_granian() -> None:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--instant"]}]) as sims:
        gw = start_gateway({"model": MODEL, "server": {"listener": "granian"},
                            "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": [sims[0].url]}]})
        try:
            resp = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10)
            assert resp.status_code == 200 and resp.headers["server"] == "granian"
            assert resp.json()["usage"]["completion_tokens"] == 5
            assert resp.headers["x-m3gate-pool"] == "interactive"
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                              timeout=10) as streamed:
                body = b"".join(streamed.iter_bytes())
            assert streamed.status_code == 200 and body.rstrip().endswith(b"data: [DONE]")
            assert body.count(b'"usage"') == 0  # the usage chunk m3gate asked for itself is not relayed
        finally:
            gw.stop()
        assert gw._proc.returncode == 0, gw.log_tail()
