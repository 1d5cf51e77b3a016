"""The simulated replica misbehaving on purpose (faults, overload, disconnects, auth) over real HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from pools.sim.launcher import SimProcess, running_sims, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "talk for a long time"}], "max_tokens": 3000,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    proc = start_sim(8192)  # real-time pace: 12 ms per decode step
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def faulty(sim: SimProcess) -> Iterator[SimProcess]:
    """The shared replica, with every fault cleared again after the test."""
    try:
        yield sim
    finally:
        sim.set_faults(error_rate=0, added_latency_ms=0, hang=False, drop_mid_stream=0, refuse_connections=False,
                       unhealthy=False)


def wait_for(predicate, timeout: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def test_stream_disconnect_aborts_the_request_and_frees_its_kv(faulty: SimProcess) -> None:
    before = faulty.stats()
    with httpx.stream("POST", f"{faulty.url}/v1/chat/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert faulty.stats()["running"] == 1
    wait_for(lambda: faulty.stats()["aborted"] == before["aborted"] + 1)
    after = faulty.stats()
    assert after["running"] == 0 and after["kv_usage"] == 0.0
    metrics = httpx.get(f"{faulty.url}/metrics").text
    assert any(ln.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in ln
               and not ln.endswith(" 0.0") for ln in metrics.splitlines())


def test_non_streaming_client_timeout_aborts_too(faulty: SimProcess) -> None:
    before = faulty.stats()["aborted"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{faulty.url}/v1/chat/completions", json=LONG, timeout=0.3)
    wait_for(lambda: faulty.stats()["aborted"] == before + 1)


def test_error_rate_gives_vllm_500s(faulty: SimProcess) -> None:
    assert faulty.set_faults(error_rate=1.0)["error_rate"] == 1.0
    client = openai.OpenAI(base_url=f"{faulty.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.body["type"] == "InternalServerError" and info.value.body["code"] == 500  # type: ignore
    faulty.set_faults(error_rate=0)
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_hang_accepts_and_never_answers(faulty: SimProcess) -> None:
    faulty.set_faults(hang=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{faulty.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=0.3)
    assert faulty.stats()["hung"] >= 1
    assert httpx.get(f"{faulty.url}/health").status_code == 200  # the process itself is fine


def test_drop_mid_stream_cuts_the_connection(faulty: SimProcess) -> None:
    faulty.set_faults(drop_mid_stream=1.0)
    received = []
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", f"{faulty.url}/v1/chat/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                received.append(line)
    assert 1 <= len([ln for ln in received if ln.startswith("data: ")]) <= 5
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{faulty.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert faulty.stats()["dropped"] >= 2


def test_unhealthy_fails_health_but_still_serves(faulty: SimProcess) -> None:
    faulty.set_faults(unhealthy=True)
    assert httpx.get(f"{faulty.url}/health").status_code == 503
    ok = httpx.post(f"{faulty.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_added_latency_delays_the_answer(faulty: SimProcess) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    faulty.set_faults(added_latency_ms=300)
    started = time.monotonic()
    httpx.post(f"{faulty.url}/v1/completions", json=body).raise_for_status()
    assert time.monotonic() - started >= 0.3


def test_refuse_connections_stops_listening_then_recovers(faulty: SimProcess) -> None:
    with httpx.Client() as admin:  # a kept-alive connection still reaches the admin API
        admin.post(f"{faulty.url}/sim/faults", json={"refuse_connections": True, "refuse_for_s": 0.6})
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{faulty.url}/health")
        assert admin.get(f"{faulty.url}/sim/faults").json()["refuse_connections"] is True
    wait_for(lambda: _reachable(faulty.url), timeout=3)
    assert faulty.stats()["faults"]["refuse_connections"] is False


def _reachable(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=0.5).status_code == 200
    except httpx.TransportError:
        return False


def test_fault_updates_are_validated(faulty: SimProcess) -> None:
    bad = httpx.post(f"{faulty.url}/sim/faults", json={"error_rate": 2})
    assert bad.status_code == 400
    typo = httpx.post(f"{faulty.url}/sim/faults", json={"eror_rate": 0.1})
    assert typo.status_code == 400


def test_stats_count_paths_and_reset_clears_the_prefix_cache(faulty: SimProcess) -> None:
    body = {"model": MODEL, "prompt": "shared prefix " * 100, "max_tokens": 1}
    faulty.reset()
    first = httpx.post(f"{faulty.url}/v1/completions", json=body).json()
    second = httpx.post(f"{faulty.url}/v1/completions", json=body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    stats = faulty.stats()
    assert stats["requests"]["/v1/completions"] == 2 and stats["completed"] == 2
    assert stats["tokens_in"] == 2 * first["usage"]["prompt_tokens"] and stats["tokens_out"] == 2
    faulty.reset()
    third = httpx.post(f"{faulty.url}/v1/completions", json=body).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert faulty.stats()["requests"] == {"/v1/completions": 1}


async def test_full_queue_answers_503_engine_busy() -> None:
    with running_sims([{"max_model_len": 4096,
                        "extra_args": ["--max-num-seqs", "1", "--max-num-queued-reqs", "1"]}]) as (busy,):
        async with httpx.AsyncClient(base_url=busy.url, timeout=10) as client:
            async def hold() -> None:
                async with client.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass

            async def until(running: int, waiting: int) -> None:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    stats = (await client.get("/sim/stats")).json()
                    if (stats["running"], stats["waiting"]) == (running, waiting):
                        return
                    await asyncio.sleep(0.02)
                raise AssertionError(stats)

            holders = [asyncio.create_task(hold())]
            try:
                await until(1, 0)  # one running: the batch (max-num-seqs 1) is full
                holders.append(asyncio.create_task(hold()))
                await until(1, 1)  # one waiting: the queue (max-num-queued-reqs 1) is full
                rejected = await client.post("/v1/chat/completions", json=LONG)
            finally:
                for task in holders:
                    task.cancel()
                await asyncio.gather(*holders, return_exceptions=True)
    assert rejected.status_code == 503
    assert rejected.json() == {"error": {
        "message": "The engine is currently busy and cannot accept new requests. Please try again later or on a "
                   "different instance.", "type": "Service Unavailable", "param": None, "code": 503}}


def test_api_key_guards_v1_only_and_start_flags_apply() -> None:
    args = ["--api-key", "sekrit", "--fault-unhealthy", "--modalities", "text,image", "--image-tokens", "300"]
    with running_sims([{"max_model_len": 2048, "extra_args": args}]) as (s,):
        denied = httpx.get(f"{s.url}/v1/models")
        assert denied.status_code == 401 and denied.json() == {"error": "Unauthorized"}
        auth = {"Authorization": "Bearer sekrit"}
        assert httpx.get(f"{s.url}/v1/models", headers=auth).status_code == 200
        assert httpx.get(f"{s.url}/health").status_code == 503  # not guarded; unhealthy from the start
        assert httpx.get(f"{s.url}/metrics").status_code == 200

        def chat(*parts: dict[str, object]) -> httpx.Response:
            return httpx.post(f"{s.url}/v1/chat/completions", headers=auth, json={
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": list(parts)}]})

        text = {"type": "text", "text": "describe"}
        plain = chat(text).json()["usage"]["prompt_tokens"]
        with_image = chat(text, {"type": "image_url", "image_url": {"url": "https://x/cat.png"}})
        assert with_image.status_code == 200
        assert with_image.json()["usage"]["prompt_tokens"] - plain in (300, 301)  # + the image, + 1 newline token
        video = chat(text, {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}})
        assert video.status_code == 400 and video.json()["error"]["message"] == (
            "At most 0 video(s) may be provided in one prompt.")


def test_prefill_time_follows_uncached_tokens(faulty: SimProcess) -> None:
    """Default costs, real time: ~6k uncached tokens take ~0.36 s of prefill; the repeat hits the cache.
    TTFT is read from the replica's own histogram so a loaded test machine does not blur it."""
    faulty.reset()
    body = {"model": MODEL, "prompt": "The same long document. " * 1000, "max_tokens": 1}

    def ttft_sum() -> float:
        text = httpx.get(f"{faulty.url}/metrics").text
        line = next(ln for ln in text.splitlines() if ln.startswith("vllm:time_to_first_token_seconds_sum"))
        return float(line.rsplit(" ", 1)[1])

    def ttft() -> float:
        before = ttft_sum()
        httpx.post(f"{faulty.url}/v1/completions", json=body, timeout=10).raise_for_status()
        return ttft_sum() - before

    cold, warm = ttft(), ttft()
    assert cold > 0.3 and cold - warm > 0.25


def test_launcher_stop_is_idempotent_and_kill_is_immediate() -> None:
    a = start_sim(1024)
    b = start_sim(1024)
    try:
        assert a.alive and b.alive and a.port != b.port
        b.kill()
        assert not b.alive
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{b.url}/health")
    finally:
        a.stop()
        a.stop()
        b.stop()
    assert not a.alive
