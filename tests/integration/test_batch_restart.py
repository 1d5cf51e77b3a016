"""Batch jobs survive the gateway that runs them: SIGKILLed mid-job and restarted on the same SQLite store, and on
PostgreSQL, two gateways on one store where the one holding the job's lease is SIGKILLed and the other takes the job
over. Either way every custom_id is in the output exactly once, the lines in flight at the kill run again."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims
from tests.integration.test_batch_api import ALICE, _client, _config, _jsonl, _line, _records, _upload, _wait
from tests.support.postgres import pg_schema

N = 40


@pytest.fixture(scope="module")
def sim() -> Any:
    with running_sims([{"max_model_len": 32768, "extra_args": ["--speed", "4"]}]) as (replica,):
        yield replica


def _create(gw: GatewayProcess) -> str:
    alice = _client(gw, ALICE)
    lines = [{**_line(i), "body": {**_line(i)["body"], "max_tokens": 16}} for i in range(N)]
    return alice.batches.create(input_file_id=_upload(alice, _jsonl(lines)), endpoint="/v1/chat/completions",
                                completion_window="24h").id


def _wait_progress(client: openai.OpenAI, batch_id: str, at_least: int) -> None:
    deadline = time.monotonic() + 20
    while client.batches.retrieve(batch_id).request_counts.completed < at_least and time.monotonic() < deadline:
        time.sleep(0.05)


def _each_custom_id_once(client: openai.OpenAI, batch_id: str) -> None:
    done = _wait(client, batch_id, {"completed", "failed"}, timeout=30)
    assert done.status == "completed" and done.request_counts.completed == N, done
    ids = [r["custom_id"] for r in _records(client, done.output_file_id)]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(N))


def test_sigkill_mid_job_then_restart_on_sqlite(sim: SimProcess, tmp_path: Path) -> None:
    config = _config(sim, {"store": f"sqlite:///{tmp_path}/store/batch.sqlite3", "files_dir": str(tmp_path / "files"),
                           "max_in_flight": 4})
    gw = start_gateway(config)
    try:
        batch_id = _create(gw)
        _wait_progress(_client(gw, ALICE), batch_id, 8)
        os.kill(gw.pid, signal.SIGKILL)  # lines in flight have no result
    finally:
        gw.stop()
    again = start_gateway(config)
    try:
        alice = _client(again, ALICE)
        assert alice.batches.retrieve(batch_id).request_counts.completed < N  # killed mid-job
        _each_custom_id_once(alice, batch_id)
    finally:
        again.stop()


def test_two_gateways_on_postgresql_the_survivor_takes_the_job_over(sim: SimProcess, tmp_path: Path) -> None:
    psycopg = pytest.importorskip("psycopg")
    with pg_schema() as url:
        config = _config(sim, {"store": url, "files_dir": str(tmp_path / "files"), "max_in_flight": 4})
        with ThreadPoolExecutor(2) as pool:
            gateways = list(pool.map(lambda _: start_gateway(config), range(2)))
        try:
            batch_id = _create(gateways[0])
            _wait_progress(_client(gateways[1], ALICE), batch_id, 8)
            with psycopg.connect(url) as conn:
                (holder,) = conn.execute("SELECT lease_owner FROM batch_jobs WHERE id = %s", (batch_id,)).fetchone()
            victim = next(gw for gw in gateways if f":{gw.pid}:" in holder)
            survivor = next(gw for gw in gateways if gw is not victim)
            os.kill(victim.pid, signal.SIGKILL)
            alice = _client(survivor, ALICE)
            assert alice.batches.retrieve(batch_id).request_counts.completed < N  # killed mid-job
            _each_custom_id_once(alice, batch_id)
            with pytest.raises(openai.NotFoundError):  # an id PostgreSQL could not even store: a 404, not a 500
                alice.batches.retrieve("batch\x00")
        finally:
            for gw in gateways:
                gw.stop()
