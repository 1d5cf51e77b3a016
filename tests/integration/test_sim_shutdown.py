"""vLLM 0.32's SIGTERM handling with --shutdown-timeout, on a real simulator process over HTTP: N > 0 lets streams
in flight finish while new requests are aborted as they arrive and /health still answers 200; N = 0 aborts the
streams in flight at once, which end with finish_reason "abort"; then the process exits."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx

from pools.sim.launcher import start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "long answer"}], "max_tokens": 80,
        "ignore_eos": True, "stream": True}


def read_stream(url: str, out: list[dict[str, Any]], started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/chat/completions", json=BODY, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                out.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                if len(out) >= 5:
                    started.set()


def finish_reasons(chunks: list[dict[str, Any]]) -> list[str]:
    return [c["finish_reason"] for ch in chunks for c in ch.get("choices", []) if c.get("finish_reason")]


def sigterm_mid_stream(timeout_s: int) -> tuple[list[dict[str, Any]], Any]:  # type: ignore[no-untyped-def]
    sim = start_sim(8192, extra_args=["--shutdown-timeout", str(timeout_s)])  # 12 ms a token: ~1 s for 80
    chunks: list[dict[str, Any]] = []
    started = threading.Event()
    reader = threading.Thread(target=read_stream, args=(sim.url, chunks, started))
    reader.start()
    assert started.wait(10)
    sim._proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    time.sleep(0.1)
    return chunks, (sim, reader)


def test_with_a_shutdown_timeout_streams_in_flight_finish_and_new_requests_are_aborted() -> None:
    chunks, (sim, reader) = sigterm_mid_stream(5)
    try:
        assert httpx.get(sim.url + "/health", timeout=5).status_code == 200  # the engine still runs
        with httpx.stream("POST", sim.url + "/v1/chat/completions", json=BODY, timeout=10) as resp:
            late = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
        assert resp.status_code == 200
        assert json.loads(late[0][6:])["choices"][0]["delta"]["role"] == "assistant"
        assert late[1:] == ["data: [DONE]"]  # aborted before its first token: no token, no finish_reason
        reader.join(10)
        assert finish_reasons(chunks) == ["length"] and chunks[-1] == {"done": True}
        assert sum(1 for c in chunks if c.get("choices") and "content" in c["choices"][0]["delta"]) == 81
        assert sim._proc.wait(5) == 0  # type: ignore[union-attr]
    finally:
        sim.stop()


def test_without_a_shutdown_timeout_streams_in_flight_are_aborted() -> None:
    chunks, (sim, reader) = sigterm_mid_stream(0)
    try:
        reader.join(10)
        assert finish_reasons(chunks) == ["abort"] and chunks[-1] == {"done": True}
        assert sim._proc.wait(5) == 0  # type: ignore[union-attr]
        try:
            httpx.get(sim.url + "/health", timeout=2)
            raise AssertionError("the server still listens")
        except httpx.ConnectError:
            pass
    finally:
        sim.stop()
