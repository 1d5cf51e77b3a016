"""vLLM 0.32's SIGTERM handling with --shutdown-timeout, as observed on a live vLLM 0.32 CPU server, on a real
simulator process over HTTP: with N > 0 new requests fail with a 500 while /health still answers 200 and streams in
flight finish; when N runs out the streams left go silent (open, no error, no [DONE]); with N = 0 streams in flight
end at once with finish_reason "abort" and the server stops listening. Then the process exits."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"


def body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "long answer"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}


class Reader(threading.Thread):
    """Streams one chat answer in the background, keeping every `data:` line."""

    def __init__(self, url: str, max_tokens: int, read_timeout: float = 30) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.read_timeout = url, max_tokens, read_timeout
        self.lines: list[str] = []
        self.started = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            timeout = httpx.Timeout(10, read=self.read_timeout)
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body(self.max_tokens),
                              timeout=timeout) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        if len(self.lines) >= 5:
                            self.started.set()
        except httpx.HTTPError as exc:
            self.error = exc
        self.started.set()

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for ln in self.lines if ln != "[DONE]"
                for c in json.loads(ln).get("choices", []) if c.get("finish_reason")]


def sigterm_mid_stream(timeout_s: int, max_tokens: int, read_timeout: float = 30) -> tuple[SimProcess, Reader]:
    sim = start_sim(8192, extra_args=["--shutdown-timeout", str(timeout_s)])  # 12 ms a token
    reader = Reader(sim.url, max_tokens, read_timeout)
    reader.start()
    assert reader.started.wait(10)
    sim._proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    time.sleep(0.2)
    return sim, reader


def test_with_a_shutdown_timeout_streams_in_flight_finish_and_new_requests_fail() -> None:
    sim, reader = sigterm_mid_stream(5, 80)
    try:
        assert httpx.get(sim.url + "/health", timeout=5).status_code == 200  # the engine still runs
        late = httpx.post(sim.url + "/v1/chat/completions", json=body(5), timeout=10)
        assert late.status_code == 500
        assert late.json()["error"] == {"message": "cannot schedule new futures after shutdown",
                                        "type": "InternalServerError", "param": None, "code": 500}
        reader.join(10)
        assert reader.finish_reasons() == ["length"] and reader.lines[-1] == "[DONE]"
        assert sim._proc.wait(5) == 0  # type: ignore[union-attr]
    finally:
        sim.stop()


def test_streams_left_when_the_shutdown_timeout_runs_out_go_silent() -> None:
    sim, reader = sigterm_mid_stream(1, 3000, read_timeout=3)
    try:
        reader.join(15)
        assert isinstance(reader.error, httpx.ReadTimeout)  # open, but nothing more: no error event, no [DONE]
        assert reader.finish_reasons() == [] and "[DONE]" not in reader.lines
        assert 5 < len(reader.lines) < 300
        assert sim._proc.wait(5) == 0  # type: ignore[union-attr]  # exits once the client has hung up
    finally:
        sim.stop()


def test_without_a_shutdown_timeout_streams_in_flight_are_aborted() -> None:
    sim, reader = sigterm_mid_stream(0, 80)
    try:
        reader.join(10)
        assert reader.finish_reasons() == ["abort"] and reader.lines[-1] == "[DONE]"
        chunks = [json.loads(ln) for ln in reader.lines[:-1]]
        abort = next(c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
        assert abort["delta"].get("content") or abort["delta"].get("reasoning")  # vLLM's abort carries the last delta
        with pytest.raises(httpx.ConnectError):
            httpx.get(sim.url + "/health", timeout=2)
        assert sim._proc.wait(5) == 0  # type: ignore[union-attr]
    finally:
        sim.stop()
