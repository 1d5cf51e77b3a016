"""The overhead bench's measuring sticks (loadtests.lib.floor_proxy, each listener / client variant, and Envoy + the
picker) must really relay, or their figures mean nothing: a non-streaming and a streamed chat through each must come
back exactly as the simulated replica answers them."""

from __future__ import annotations

import json
import urllib.request

import pytest

from loadtests.lib.peers import start_peer
from pools.sim.launcher import running_sims


def _post(url: str, body: dict) -> tuple[int, bytes, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.read(), resp.headers.get("content-type", "")


@pytest.mark.parametrize("name", ["floor", "floor-raw", "floor-granian", "floor-granian-rsgi",
                                  "floor-granian-rsgi-raw", "envoy+epp", "envoy+epp-none"])
def test_floor_proxy_relays_plain_and_streamed_answers(name: str) -> None:
    if name.startswith("floor-granian"):
        import granian  # noqa: F401 - in the test extra: a missing or broken install fails here, it never skips
    body = {"model": "MiniMaxAI/MiniMax-M3", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 5, "ignore_eos": True, "seed": 1, "temperature": 0}
    with running_sims([{"max_model_len": 4096, "extra_args": ["--instant"]}]) as sims:
        peer = start_peer(name, [sims[0].url], timeout_s=90)
        try:
            status, raw, ctype = _post(peer.url + "/v1/chat/completions", body)
            assert status == 200 and ctype.startswith("application/json")
            answer = json.loads(raw)
            assert answer["usage"]["completion_tokens"] == 5
            assert answer["choices"][0]["message"]["content"]

            status, raw, ctype = _post(peer.url + "/v1/chat/completions", {**body, "stream": True})
            assert status == 200 and ctype.startswith("text/event-stream")
            events = [e for e in raw.decode().split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            tokens = [json.loads(e[6:]) for e in events[:-1]]
            # one event per token, whether the sim's greedy answer put it in reasoning or in content
            deltas = [t["choices"][0]["delta"] for t in tokens if t["choices"]]
            assert sum(1 for d in deltas if d.get("content") or d.get("reasoning")) == 5
        finally:
            peer.stop()
        assert all(proc.poll() is not None for proc in peer.procs)  # envoy+epp: the picker and Envoy
