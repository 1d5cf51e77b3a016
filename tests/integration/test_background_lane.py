"""The background lane through a real gateway in front of one simulated replica that runs at most four sequences at
once (more wait inside it: `vllm:num_requests_waiting`, which the gateway reads as saturation at 1): a background
class fills the spare capacity of an idle pool (its window grows from one as its requests succeed, never more of
them in flight than the window), and a foreground burst that saturates the replica shrinks the window while the
foreground is served."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
BATCH = {"x-m3gate-class": "batch"}


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--max-num-seqs", "4"]}]) as sims:
        gw = start_gateway({
            "model": MODEL,
            "pools": [{"name": "p", "max_model_len": 8192, "endpoints": [sims[0].url]}],
            "server": {"health_interval_s": 0.1},
            "traffic": {
                "pool_classes": {"p": "chat"},
                "saturation": {"max_waiting": 1},
                "classes": {
                    "chat": {"priority": 0, "max_concurrency": 32, "queue_length": 64, "max_queue_wait_s": 60,
                             "ttft_target_s": 30},
                    "batch": {"priority": 9, "background": True, "max_concurrency": 8, "queue_length": 64,
                              "max_queue_wait_s": 60},
                },
            },
        })
        try:
            yield gw
        finally:
            gw.stop()


def _lane(gw: GatewayProcess) -> dict[str, Any]:
    pool = httpx.get(gw.url + "/admin/traffic", timeout=5).json()["pools"].get("p", {})
    return pool.get("background", {}).get("batch", {})


def _stream(client: openai.OpenAI, tokens: int, headers: dict[str, str] | None = None) -> str:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go on"}], max_tokens=tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "disabled"}},
        extra_headers=headers)
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _in_threads(n: int, fn: Callable[[], str]) -> tuple[list[threading.Thread], list[str]]:
    out: list[str] = []

    def run() -> None:
        out.append(fn())

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, out


def _watch(gw: GatewayProcess, threads: list[threading.Thread], seen: list[dict[str, Any]]) -> None:
    while any(t.is_alive() for t in threads):
        lane = _lane(gw)
        if lane:
            seen.append(lane)
        time.sleep(0.02)


def test_background_fills_spare_capacity_within_its_window(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0, timeout=60)
    threads, answers = _in_threads(10, lambda: _stream(client, 24, BATCH))
    seen: list[dict[str, Any]] = []
    _watch(gateway, threads, seen)
    assert len(answers) == 10 and all(answers)
    assert all(s["in_flight"] <= s["window"] for s in seen)  # never more in flight than the window allowed
    assert max(s["window"] for s in seen) >= 3  # it grew from one on an idle pool: the spare capacity is used
    lane = _lane(gateway)
    assert lane["increases"] >= 2
    metrics = httpx.get(gateway.url + "/metrics", timeout=5).text
    assert f'm3gate_background_window{{class="batch",pool="p"}} {float(lane["window"])}' in metrics


def test_a_foreground_burst_shrinks_the_window_and_is_served(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0, timeout=60)
    warm, _ = _in_threads(10, lambda: _stream(client, 16, BATCH))  # grow the window first
    for t in warm:
        t.join(60)
    before = _lane(gateway)
    assert before["window"] >= 3
    background, bg_answers = _in_threads(6, lambda: _stream(client, 400, BATCH))
    deadline = time.monotonic() + 10
    while _lane(gateway)["in_flight"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    burst, answers = _in_threads(8, lambda: _stream(client, 8))  # more than the replica runs at once: it saturates
    deadline = time.monotonic() + 20
    while _lane(gateway)["decreases"] <= before["decreases"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _lane(gateway)["decreases"] > before["decreases"]
    assert _lane(gateway)["window"] < before["window"]
    for t in burst + background:
        t.join(60)
    assert len(answers) == 8 and all(answers)  # the foreground was served
    assert len(bg_answers) == 6 and all(bg_answers)  # and the background finished, late
