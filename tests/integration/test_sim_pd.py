"""Prefill/decode disaggregation between simulated replicas over real HTTP, as vLLM 0.32's NixlConnector does it:
the prefill answer's kv_transfer_params, the decode side's pull, block holding and release (read, lease expiry,
refusal), failures, heartbeats, `--role both` unchanged, and the decode-step interference disaggregation removes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
BLOCK = 16
PARAM_KEYS = ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
              "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
              "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens"]
GENERATION_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                              "code": 500}}


def sim(role: str, *extra: str, max_model_len: int = 4096) -> SimProcess:
    return start_sim(max_model_len, extra_args=["--role", role, "--block-size", str(BLOCK), "--speed", "20",
                                                "--seed", "3", *extra])


@pytest.fixture(scope="module")
def prefill() -> Iterator[SimProcess]:
    proc = sim("prefill", "--engine-id", "prefill-a")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def decode() -> Iterator[SimProcess]:
    proc = sim("decode")
    try:
        yield proc
    finally:
        proc.stop()


def prompt(tag: str, tokens: int) -> str:
    return (tag * 4)[:4] * tokens  # the built-in tokenizer: 4 bytes per token


def complete(replica: SimProcess, text: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{replica.url}/v1/completions", json={"model": MODEL, "prompt": text, **body}, timeout=20)


TOY_PROXY_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_step(replica: SimProcess, text: str) -> dict[str, Any]:
    """What a P/D proxy sends a prefill replica (vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py:
    these params, max_tokens 1, no streaming)."""
    r = complete(replica, text, max_tokens=1, stream=False, kv_transfer_params=TOY_PROXY_PREFILL_PARAMS)
    assert r.status_code == 200, r.text
    return r.json()


def kv_stats(replica: SimProcess) -> dict[str, Any]:
    stats = replica.stats()["kv_transfer"]
    assert stats is not None
    return stats


def wait_for(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def sse(text: str) -> list[Any]:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in text.split("\n\n") if line.startswith("data: ")]


def test_prefill_answer_carries_nixl_params_and_holds_blocks(prefill: SimProcess) -> None:
    before = kv_stats(prefill)
    body = prefill_step(prefill, prompt("p1", 100))
    params = body["kv_transfer_params"]
    assert list(params) == PARAM_KEYS
    n = body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == -(-n // BLOCK)
    assert params["remote_engine_id"] == "prefill-a"
    assert params["remote_request_id"].startswith(body["id"] + "-")  # vLLM's internal id: 8 random chars appended
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.port)
    assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
    assert params["remote_num_tokens"] == n and params["remote_blocks_expiry_time"] is None
    assert params["transfer_mode"] == "pull" and params["remote_prefill_cached_tokens"] == 0
    after = kv_stats(prefill)
    assert after["held_requests"] == before["held_requests"] + 1
    assert after["held_blocks"] == before["held_blocks"] + len(params["remote_block_ids"][0])

    again = prefill_step(prefill, prompt("p1", 100))["kv_transfer_params"]  # held blocks still serve prefix hits
    assert again["remote_prefill_cached_tokens"] == (n - 1) // BLOCK * BLOCK
    for p in (params, again):  # hand them back so later tests start clean
        httpx.post(f"{prefill.url}/sim/kv/read", json={"request_id": p["remote_request_id"]})


def test_decode_pulls_streams_and_reports_the_prefill_sides_cached_tokens(prefill: SimProcess,
                                                                          decode: SimProcess) -> None:
    text = prompt("d1", 150)
    params = prefill_step(prefill, text)["kv_transfer_params"]
    held = kv_stats(prefill)["released_after_read"]
    r = complete(decode, text, max_tokens=6, stream=True, stream_options={"include_usage": True},
                 kv_transfer_params=params, ignore_eos=True)
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-2])
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 6
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}  # the prefill side's hits, as vLLM reports them
    stats = kv_stats(decode)
    assert stats["pulled_blocks"] >= len(params["remote_block_ids"][0])
    wait_for(lambda: kv_stats(prefill)["released_after_read"] == held + 1)  # the read notification freed them
    assert kv_stats(prefill)["held_requests"] == 0

    # the pulled blocks joined the decode replica's prefix cache
    n = params["remote_num_tokens"]
    local = complete(decode, text, max_tokens=1).json()
    assert local["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BLOCK * BLOCK
    metrics = httpx.get(f"{decode.url}/metrics").text
    assert 'vllm:prompt_tokens_by_source_total{engine="0",model_name="MiniMaxAI/MiniMax-M3",' \
           'source="external_kv_transfer"}' in metrics
    assert "vllm:nixl_xfer_time_seconds_count" in metrics


def test_decode_without_forwarded_cached_count_reports_the_whole_prompt(prefill: SimProcess,
                                                                      decode: SimProcess) -> None:
    text = prompt("d2", 90)
    params = prefill_step(prefill, text)["kv_transfer_params"]
    del params["remote_prefill_cached_tokens"]
    body = complete(decode, text, max_tokens=3, kv_transfer_params=params).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == body["usage"]["prompt_tokens"]
    assert body["kv_transfer_params"] is None  # the decode side hands nothing on
    wait_for(lambda: kv_stats(prefill)["held_requests"] == 0)


def test_blocks_are_released_when_the_lease_expires_and_a_late_read_still_decodes(decode: SimProcess) -> None:
    short = sim("prefill", "--kv-lease-duration", "0.3")
    try:
        text = prompt("e1", 80)
        params = prefill_step(short, text)["kv_transfer_params"]
        assert kv_stats(short)["held_requests"] == 1
        wait_for(lambda: kv_stats(short)["expired"] == 1, timeout=3)
        assert kv_stats(short)["held_requests"] == 0
        assert 'vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="MiniMaxAI/MiniMax-M3"} 1.0' in \
            httpx.get(f"{short.url}/metrics").text

        # vLLM's decode side reads the (possibly reused) blocks anyway and decodes; the prefill side logs it
        r = complete(decode, text, max_tokens=4, kv_transfer_params=params)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        wait_for(lambda: kv_stats(short)["notifications_after_expiry"] == 1)
        assert "Potentially invalid KV blocks for unrecognized request" in short.log()
        assert "Releasing expired KV blocks" in short.log()
    finally:
        short.stop()


def test_heartbeats_keep_the_lease_while_the_decode_side_is_busy() -> None:
    p = sim("prefill", "--kv-lease-duration", "0.6")
    d = start_sim(4096, extra_args=["--role", "decode", "--block-size", str(BLOCK), "--max-num-seqs", "1",
                                    "--kv-lease-duration", "0.6"])  # its own lease sets the heartbeat interval
    try:
        params = prefill_step(p, prompt("h1", 60))["kv_transfer_params"]
        busy = threading.Thread(target=complete, args=(d, prompt("h2", 20)),
                                kwargs={"max_tokens": 100, "ignore_eos": True})  # ~1.2 s at 12 ms a step
        busy.start()
        wait_for(lambda: d.stats()["running"] == 1)
        r = complete(d, prompt("h1", 60), max_tokens=2, kv_transfer_params=params)  # waits behind it
        busy.join()
        assert r.status_code == 200
        stats = kv_stats(p)
        assert stats["expired"] == 0 and stats["heartbeats_received"] >= 2
        wait_for(lambda: kv_stats(p)["released_after_read"] == 1)
    finally:
        p.stop()
        d.stop()


def test_roles_are_labels_as_in_nixl(decode: SimProcess) -> None:
    """NixlConnector acts on each request's params whatever kv_role says, so a decode replica can prefill too."""
    params = prefill_step(decode, prompt("x1", 40))["kv_transfer_params"]
    assert params["remote_port"] == decode.port and params["do_remote_prefill"] is True
    httpx.post(f"{decode.url}/sim/kv/read", json={"request_id": params["remote_request_id"]})
    assert kv_stats(decode)["held_requests"] == 0


def test_a_decode_request_refused_before_the_engine_frees_the_prefill_blocks(prefill: SimProcess,
                                                                             decode: SimProcess) -> None:
    params = prefill_step(prefill, prompt("r1", 40))["kv_transfer_params"]
    released = kv_stats(prefill)["released_after_read"]
    r = complete(decode, prompt("r1", 40), max_tokens=5000, kv_transfer_params=params)
    assert r.status_code == 400
    wait_for(lambda: kv_stats(prefill)["released_after_read"] == released + 1)


def test_unreachable_or_restarted_prefill_fails_the_request_like_vllm(prefill: SimProcess,
                                                                     decode: SimProcess) -> None:
    text = prompt("f1", 70)
    params = {**prefill_step(prefill, text)["kv_transfer_params"], "remote_engine_id": "restarted"}
    r = complete(decode, text, max_tokens=4, kv_transfer_params=params)
    assert r.status_code == 500 and r.json() == GENERATION_ERROR

    chat = httpx.post(f"{decode.url}/v1/chat/completions", timeout=20, json={
        "model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True, "max_tokens": 4,
        "kv_transfer_params": {**params, "remote_port": 1}})  # nothing listens there
    events = sse(chat.text)
    assert chat.status_code == 200 and len(events) == 3
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1] == GENERATION_ERROR and events[2] == "[DONE]"
    assert kv_stats(decode)["failed_pulls"] >= 2
    metrics = httpx.get(f"{decode.url}/metrics").text
    assert 'vllm:request_success_total{engine="0",finished_reason="error",model_name="MiniMaxAI/MiniMax-M3"} 2.0' \
        in metrics
    assert 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="MiniMaxAI/MiniMax-M3"} 2.0' in metrics
    httpx.post(f"{prefill.url}/sim/kv/read", json={"request_id": params["remote_request_id"]})


def test_recompute_policy_computes_the_prompt_locally(prefill: SimProcess) -> None:
    d = sim("decode", "--kv-load-failure-policy", "recompute")
    try:
        text = prompt("g1", 70)
        params = {**prefill_step(prefill, text)["kv_transfer_params"], "remote_engine_id": "restarted"}
        r = complete(d, text, max_tokens=4, kv_transfer_params=params)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert kv_stats(d)["failed_pulls"] == 1
        httpx.post(f"{prefill.url}/sim/kv/read", json={"request_id": params["remote_request_id"]})
    finally:
        d.stop()


def test_role_both_ignores_kv_transfer_params() -> None:
    plain = start_sim(4096, extra_args=["--speed", "20"])
    try:
        body = complete(plain, prompt("b1", 50), max_tokens=1, kv_transfer_params={"do_remote_decode": True}).json()
        assert body["kv_transfer_params"] is None
        assert plain.stats()["kv_transfer"] is None
        assert httpx.get(f"{plain.url}/sim/kv/handshake").status_code == 404
        assert "nixl" not in httpx.get(f"{plain.url}/metrics").text
    finally:
        plain.stop()


def stream_gaps(replica: SimProcess, start: threading.Event, tokens: int = 60) -> list[tuple[float, float]]:
    """Streams a long answer; returns (arrival, gap since the previous token) and sets `start` after 5 tokens."""
    out: list[tuple[float, float]] = []
    last = None
    with httpx.stream("POST", f"{replica.url}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": prompt("s1", 30), "max_tokens": tokens, "ignore_eos": True,
            "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if last is not None:
                out.append((now, now - last))
            last = now
            if len(out) == 5:
                start.set()
    return out


def worst_gap_while(replica: SimProcess, send_long_prompt: Any) -> float:
    """The largest inter-token gap a running stream sees from the moment a long prompt is sent to it."""
    start = threading.Event()
    result: list[list[tuple[float, float]]] = []
    t = threading.Thread(target=lambda: result.append(stream_gaps(replica, start)))
    t.start()
    assert start.wait(10)
    sent = time.monotonic()
    send_long_prompt()
    t.join()
    return max(gap for at, gap in result[0] if at >= sent)


def test_a_long_prefill_stalls_running_streams_but_a_pulled_prompt_does_not() -> None:
    """vLLM's chunked prefill shares the step with decodes: an 8,000-token prompt makes one step of ~0.5 s
    (12 ms + 60 µs a token), which every running stream waits for. On a decode replica the same prompt arrives by
    KV transfer (out of the batch), and only its last token is computed."""
    long_text = prompt("L1", 8000)
    args = ["--block-size", "128", "--seed", "3"]
    mixed = start_sim(16384, extra_args=["--role", "both", *args])
    p = start_sim(16384, extra_args=["--role", "prefill", *args])
    d = start_sim(16384, extra_args=["--role", "decode", *args])
    try:
        stalled = worst_gap_while(mixed, lambda: complete(mixed, long_text, max_tokens=1))
        params = prefill_step(p, long_text)["kv_transfer_params"]
        calm = worst_gap_while(d, lambda: complete(d, long_text, max_tokens=1, kv_transfer_params=params))
        assert stalled > 0.35, stalled
        assert calm < 0.15, calm
    finally:
        for proc in (mixed, p, d):
            proc.stop()
