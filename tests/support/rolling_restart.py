"""A rolling restart of a pool of simulated replicas behind a gateway, under steady streaming load from the OpenAI
SDK, each replica restarted the way Kubernetes does it: SIGTERM, wait for the process to exit, start a new one at the
same address, wait until it is healthy (tests/integration/test_rolling_restart*.py)."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from gateway.cli.launcher import GatewayProcess
from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
POOL = "interactive"
MAX_TOKENS = 100
CHAT_PATH = "/v1/chat/completions"


def sim_args(shutdown_timeout: int) -> list[str]:
    # --speed 0.4: ~30 ms a token, so a 100-token stream runs ~3 s and a drain lasts that long
    return ["--shutdown-timeout", str(shutdown_timeout), "--speed", "0.4"]


def gateway_config(replicas: list[SimProcess]) -> dict[str, Any]:
    return {"model": MODEL, "pools": [{"name": POOL, "max_model_len": 8192, "endpoints": [s.url for s in replicas]}],
            "server": {"health_interval_s": 0.3}}


@dataclass
class Load:
    """`streams` threads, each streaming one chat answer after another through the gateway with the real OpenAI SDK
    (no SDK retries: every failure the gateway lets through is counted) until stopped."""

    base_url: str
    streams: int = 8
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for _ in range(self.streams):
            t = threading.Thread(target=self._run, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self) -> None:
        client = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60)
        while not self._stop.is_set():
            error = self._one(client)
            with self._lock:
                if error is None:
                    self.completed += 1
                else:
                    self.failures.append(error)

    @staticmethod
    def _one(client: openai.OpenAI) -> str | None:
        """None when the stream ended whole: every token, finish_reason "length", usage; else what went wrong."""
        finish, usage, chunks = None, None, 0
        try:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"tell me a story {uuid.uuid4().hex}"}],
                max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            for chunk in stream:
                chunks += 1
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
        except openai.OpenAIError as exc:
            return f"{type(exc).__name__}: {exc}"
        if finish != "length" or usage != MAX_TOKENS:
            return f"stream ended with finish_reason={finish!r}, completion_tokens={usage!r} after {chunks} chunks"
        return None


def replica_view(gw: GatewayProcess, url: str) -> dict[str, Any]:
    return httpx.get(gw.url + "/admin/pools", timeout=5).json()["pools"][POOL]["replicas"][url]


def chat_requests(sim: SimProcess) -> int | None:
    """Chat requests that reached the replica (refused ones included), or None once it no longer answers."""
    try:
        return int(httpx.get(sim.url + "/sim/stats", timeout=2).json()["requests"].get(CHAT_PATH, 0))
    except httpx.HTTPError:
        return None


def wait_for(predicate: Any, timeout: float, what: str, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


@dataclass
class Restart:
    """What one replica's restart looked like from outside."""

    url: str
    reached_before_mark: int = 0  # requests that reached it after SIGTERM until the gateway drained it (refused)
    reached_after_mark: int = 0  # requests that reached it after the gateway drained it: must be 0
    seconds: float = 0.0  # SIGTERM to back in the gateway's rotation
    reason: str = ""  # why the gateway drained it


def restart(gw: GatewayProcess, sim: SimProcess, shutdown_timeout: int, nudge: Any) -> tuple[SimProcess, Restart]:
    """SIGTERM `sim` (once it has streams in flight), wait for its exit, start a new one on its port, wait until the
    gateway routes to it again. `nudge()` sends one short request through the gateway: repeated after SIGTERM, so
    that the gateway meets the replica's refusal soon even at a low request rate."""
    result = Restart(sim.url)
    wait_for(lambda: (s := _stats(sim)) is not None and s["running"] >= 2, 30, f"streams in flight on {sim.url}")
    before = chat_requests(sim) or 0
    t0 = time.monotonic()
    sim._proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    marked_at = None
    last = before
    while True:
        if marked_at is None and not (view := replica_view(gw, sim.url))["available"]:
            marked_at = time.monotonic()
            result.reason = view["drain_reason"] or ("unhealthy" if not view["healthy"] else "ejected")
            time.sleep(0.2)  # requests the gateway had sent before it knew land now
            result.reached_before_mark = (chat_requests(sim) or last) - before
            last = before + result.reached_before_mark
        if marked_at is not None and time.monotonic() - marked_at < 1.0:
            nudge()  # the gateway must keep these (and the load's) off the draining replica
        count = chat_requests(sim)
        if count is not None:
            last = count
        elif marked_at is not None:
            break  # gone, and the gateway knew it first
        if marked_at is None:
            assert time.monotonic() - t0 < shutdown_timeout + 30, f"the gateway never drained {sim.url}"
            nudge()
    assert marked_at is not None, f"the gateway never drained {sim.url}"
    result.reached_after_mark = last - before - result.reached_before_mark
    assert sim._proc.wait(shutdown_timeout + 30) == 0  # type: ignore[union-attr]
    new = start_sim(8192, port=sim.port, extra_args=sim_args(shutdown_timeout))
    wait_for(lambda: replica_view(gw, new.url)["available"], 30, f"{new.url} back in rotation")
    result.seconds = time.monotonic() - t0
    return new, result


def _stats(sim: SimProcess) -> dict[str, Any] | None:
    try:
        return httpx.get(sim.url + "/sim/stats", timeout=2).json()
    except httpx.HTTPError:
        return None
