"""The Batch API through a real gateway process in front of a simulated replica, with the official OpenAI SDK as the
client: upload, create, poll, download, list, cancel, expiry, access by key, validation errors, 413s, metrics. The
restart and takeover cases are tests/integration/test_batch_restart.py."""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
ALICE, BOB, ADMIN = "sk-alice-0123456789", "sk-bob-0123456789", "admin-secret-0123456789"
MAX_BODY = 64 * 1024
MAX_FILE = 512 * 1024
MAX_REQUESTS = 300
SYSTEMS = ["You are a careful reviewer.", "You translate to French."]


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _config(sim: SimProcess, batch: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [{"name": "p", "max_model_len": 32768, "endpoints": [sim.url]}],
        "server": {"max_body_bytes": MAX_BODY},
        "access": {"keys": [{"name": "alice", "key_sha256": _sha(ALICE)}, {"name": "bob", "key_sha256": _sha(BOB)}]},
        "admin": {"api_key": ADMIN},
        "batch": {"max_file_bytes": MAX_FILE, "max_requests": MAX_REQUESTS, "lease_s": 1.0,
                  "completion_windows": ["24h", "2s"],
                  "poll_interval_s": 0.1, **batch},
    }


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with running_sims([{"max_model_len": 32768, "extra_args": ["--speed", "4"]}]) as (replica,):
        yield replica


@pytest.fixture(scope="module")
def gateway(sim: SimProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    files = tmp_path_factory.mktemp("batch-files")
    gw = start_gateway(_config(sim, {"files_dir": str(files), "max_in_flight": 4}))
    try:
        yield gw
    finally:
        gw.stop()


def _client(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=30)


def _line(i: int, **over: Any) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]}, {"role": "user", "content": f"item {i}"}]}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body, **over}


def _jsonl(lines: list[Any]) -> bytes:
    return b"".join((json.dumps(x) if not isinstance(x, str) else x).encode() + b"\n" for x in lines)


def _upload(client: openai.OpenAI, content: bytes) -> str:
    return client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch").id


def _wait(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses or time.monotonic() > deadline:
            return batch
        time.sleep(0.1)


def _records(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_round_trip_with_the_sdk(gateway: GatewayProcess) -> None:
    alice = _client(gateway, ALICE)
    input_id = _upload(alice, _jsonl([_line(i) for i in range(12)]))
    batch = alice.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata={"suite": "smoke"})
    assert batch.status == "validating" and batch.metadata == {"suite": "smoke"}
    done = _wait(alice, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    out = _records(alice, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(12))
    for record in out:
        assert record["error"] is None and record["id"].startswith("batch_req_")
        assert record["response"]["status_code"] == 200
        assert record["response"]["body"]["choices"][0]["message"]["content"]
    assert alice.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in alice.batches.list(limit=5).data]


def test_keys_see_only_their_own_and_the_admin_sees_all(gateway: GatewayProcess) -> None:
    alice, bob, admin = _client(gateway, ALICE), _client(gateway, BOB), _client(gateway, ADMIN)
    input_id = _upload(alice, _jsonl([_line(0)]))
    batch = alice.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(input_id)
    with pytest.raises(openai.NotFoundError):  # bob cannot run alice's file either
        bob.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.id not in [b.id for b in bob.batches.list().data]
    assert admin.batches.retrieve(batch.id).id == batch.id
    assert batch.id in [b.id for b in admin.batches.list(limit=100).data]
    with pytest.raises(openai.PermissionDeniedError):
        _upload(admin, _jsonl([_line(0)]))
    with pytest.raises(openai.AuthenticationError):
        _client(gateway, "sk-nobody-0123456789").batches.list()


def test_list_pages_with_after(gateway: GatewayProcess) -> None:
    bob = _client(gateway, BOB)
    input_id = _upload(bob, _jsonl([_line(0)]))
    ids = [bob.batches.create(input_file_id=input_id, endpoint="/v1/chat/completions",
                              completion_window="24h").id for _ in range(3)]
    first = bob.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    rest = bob.batches.list(limit=2, after=first.data[-1].id)
    assert rest.data[0].id == ids[0]


def test_validation_errors_name_their_lines(gateway: GatewayProcess) -> None:
    alice = _client(gateway, ALICE)
    big = _line(6)
    big["body"]["messages"][1]["content"] = "x" * (MAX_BODY + 10)
    lines = [_line(0), "{not json", _line(0), _line(3, url="/v1/completions"),
             _line(4, body={"model": "other-model", "messages": []}), big]
    batch = alice.batches.create(input_file_id=_upload(alice, _jsonl(lines)), endpoint="/v1/chat/completions",
                                 completion_window="24h")
    failed = _wait(alice, batch.id, {"failed", "completed"})
    assert failed.status == "failed" and failed.failed_at
    found = [(e.line, e.code) for e in failed.errors.data]
    assert found == [(2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_url"),
                     (5, "model_not_found"), (6, "request_too_large")]
    with pytest.raises(openai.BadRequestError) as bad:
        alice.batches.create(input_file_id=_upload(alice, _jsonl([_line(0)])), endpoint="/v1/embeddings",
                             completion_window="24h")
    assert bad.value.body["param"] == "endpoint"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        alice.batches.create(input_file_id=_upload(alice, _jsonl([_line(0)])), endpoint="/v1/chat/completions",
                             completion_window="1h")


def test_uploads_over_the_limits_get_a_413(gateway: GatewayProcess) -> None:
    alice = _client(gateway, ALICE)
    with pytest.raises(openai.APIStatusError) as large:
        _upload(alice, b"x" * (MAX_FILE + 100 * 1024))
    assert large.value.status_code == 413 and f"{MAX_FILE:,}" in large.value.message
    with pytest.raises(openai.APIStatusError) as many:
        _upload(alice, b"{}\n" * (MAX_REQUESTS + 1))
    assert many.value.status_code == 413 and f"{MAX_REQUESTS:,}" in many.value.message
    with pytest.raises(openai.BadRequestError):
        alice.files.create(file=("input.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")


def test_cancel_stops_dispatching_and_keeps_partial_output(gateway: GatewayProcess) -> None:
    alice = _client(gateway, ALICE)
    lines = [{**_line(i), "body": {**_line(i)["body"], "max_tokens": 200}} for i in range(120)]
    batch = alice.batches.create(input_file_id=_upload(alice, _jsonl(lines)), endpoint="/v1/chat/completions",
                                 completion_window="24h")
    started = _wait(alice, batch.id, {"in_progress", "completed"})
    assert started.status == "in_progress"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the status page lists it with its progress once the runner has looked
        jobs = httpx.get(gateway.url + "/ui/state", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5).json()
        shown = [j for j in jobs["batch"] if j["id"] == batch.id]
        if shown and shown[0]["total"] == 120:
            break
        time.sleep(0.05)
    assert shown and shown[0]["owner"] == "alice" and shown[0]["expires_at"] == started.expires_at
    assert alice.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    cancelled = _wait(alice, batch.id, {"cancelled"})
    assert cancelled.status == "cancelled" and cancelled.cancelled_at
    counts = cancelled.request_counts
    assert counts.total == 120 and counts.completed < 120
    out = _records(alice, cancelled.output_file_id)
    assert len(out) == counts.completed == len({r["custom_id"] for r in out})
    with pytest.raises(openai.ConflictError):
        alice.batches.cancel(_wait(alice, alice.batches.create(
            input_file_id=_upload(alice, _jsonl([_line(0)])), endpoint="/v1/chat/completions",
            completion_window="24h").id, {"completed"}).id)


def test_past_its_window_a_job_expires_with_batch_expired_for_the_rest(gateway: GatewayProcess) -> None:
    alice = _client(gateway, ALICE)
    lines = [{**_line(i), "body": {**_line(i)["body"], "max_tokens": 200}} for i in range(120)]
    batch = alice.batches.create(input_file_id=_upload(alice, _jsonl(lines)), endpoint="/v1/chat/completions",
                                 completion_window="2s")
    expired = _wait(alice, batch.id, {"expired", "completed"})
    assert expired.status == "expired" and expired.expired_at
    done, missed = _records(alice, expired.output_file_id), _records(alice, expired.error_file_id)
    assert missed and all(r["error"]["code"] == "batch_expired" and r["response"] is None for r in missed)
    assert sorted(r["custom_id"] for r in done + missed) == sorted(f"req-{i}" for i in range(120))
    counts = expired.request_counts
    assert (counts.completed, counts.failed) == (len(done), len(missed))


def test_metrics_and_files_listing(gateway: GatewayProcess) -> None:
    alice = _client(gateway, ALICE)
    assert any(f.purpose == "batch" for f in alice.files.list().data)
    file_id = _upload(alice, _jsonl([_line(0)]))
    assert alice.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(file_id)
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    assert 'm3gate_batch_requests_total{status="completed"}' in text
    assert 'm3gate_batch_jobs{status="completed"}' in text
    assert 'm3gate_batch_requests_total{status="expired"}' in text
