"""Batch deadlines through a real gateway in front of a simulated replica that runs four sequences at once, with the
OpenAI SDK as the client: a job whose 30 s window is far too short for its lines, behind continuous foreground load,
is predicted to miss it; its batch object's `m3gate` field says so (the SDK still parses the object), its share step
rises, the background lane's floor with it, the metrics count the raises, and the foreground is still served."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
WINDOW_PER_STEP = 2


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--max-num-seqs", "4"]}]) as sims:
        gw = start_gateway({
            "model": MODEL,
            "pools": [{"name": "p", "max_model_len": 8192, "endpoints": [sims[0].url]}],
            "traffic": {
                "pool_classes": {"p": "chat"},
                "classes": {
                    "chat": {"priority": 0, "max_concurrency": 32, "queue_length": 64, "max_queue_wait_s": 60,
                             "ttft_target_s": 30},
                    "batch": {"priority": 9, "background": True, "max_concurrency": 8, "queue_length": 64,
                              "max_queue_wait_s": 60},
                },
            },
            "batch": {"completion_windows": ["24h", "30s"], "poll_interval_s": 0.1, "max_in_flight": 8,
                      "deadline": {"step_interval_s": 1.0, "max_step": 3, "window_per_step": WINDOW_PER_STEP}},
        })
        try:
            yield gw
        finally:
            gw.stop()


def _line(i: int) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 100, "ignore_eos": True,
            "messages": [{"role": "system", "content": "Summarize."}, {"role": "user", "content": f"item {i}"}]}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _foreground(client: openai.OpenAI, stop: threading.Event, answers: list[str], errors: list[Exception]) -> None:
    """Short interactive streams, one after another, until told to stop."""
    while not stop.is_set():
        try:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16, stream=True,
                extra_body={"ignore_eos": True})
            answers.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        except Exception as exc:  # noqa: BLE001 - counted: the foreground must not fail
            errors.append(exc)


def _metric(text: str, name: str) -> float | None:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def _lane(gw: GatewayProcess) -> dict[str, Any]:
    pools = httpx.get(gw.url + "/admin/traffic", timeout=5).json()["pools"]
    return dict(pools.get("p", {}).get("background", {}).get("batch", {}))


def test_a_job_behind_its_window_is_at_risk_and_gets_a_larger_share(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0, timeout=30)
    stop, answers, errors = threading.Event(), [], []  # type: ignore[var-annotated]
    load = [threading.Thread(target=_foreground, args=(client, stop, answers, errors)) for _ in range(2)]
    for thread in load:
        thread.start()
    try:
        content = b"".join(json.dumps(_line(i)).encode() + b"\n" for i in range(200))
        input_id = client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch").id
        batch = client.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions",
                                      completion_window="30s")
        assert batch.model_extra is not None and batch.model_extra["m3gate"]["share_step"] == 0
        deadline, outlook, lane = time.monotonic() + 25, {}, {}
        while time.monotonic() < deadline:  # 200 lines of 100 tokens on four sequences: well over 30 s
            found = client.batches.retrieve(batch.id)
            assert found.status in ("validating", "in_progress"), found
            outlook = (found.model_extra or {})["m3gate"]
            lane = _lane(gateway)
            if outlook["at_risk"] and outlook["share_step"] >= 1 and lane.get("floor", 0) >= WINDOW_PER_STEP:
                break
            time.sleep(0.2)
        assert outlook["at_risk"] and outlook["share_step"] >= 1, outlook
        assert isinstance(outlook["lines_per_s"], float)
        assert outlook["predicted_finish_at"] is None or outlook["predicted_finish_at"] > found.in_progress_at
        # the lane's floor follows the step: its window is held at least there (below the class's 8)
        assert lane["floor"] >= WINDOW_PER_STEP and lane["window"] >= lane["floor"], lane
        metrics = httpx.get(gateway.url + "/metrics", timeout=5).text
        assert (_metric(metrics, "m3gate_batch_share_raises_total") or 0) >= 1
        assert f'm3gate_batch_share_step{{batch="{batch.id}"}}' in metrics
        assert f'm3gate_batch_lines_per_second{{batch="{batch.id}"}}' in metrics
        assert _metric(metrics, "m3gate_batch_jobs_at_risk") is not None
        listed = [b for b in client.batches.list(limit=5).data if b.id == batch.id]
        assert listed and (listed[0].model_extra or {})["m3gate"]["share_step"] >= 1
        client.batches.cancel(batch.id)
        deadline = time.monotonic() + 20
        while client.batches.retrieve(batch.id).status != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.2)
        done = client.batches.retrieve(batch.id)
        assert done.status == "cancelled"
        assert (done.model_extra or {})["m3gate"] == {"predicted_finish_at": None, "lines_per_s": 0.0,
                                                      "at_risk": False, "share_step": 0}
    finally:
        stop.set()
        for thread in load:
            thread.join(30)
    assert answers and not errors, errors[:3]  # the foreground was served throughout
