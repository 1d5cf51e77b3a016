"""`server.workers`: refused without Redis state (the workers would not route as one) and with granian; the
supervisor's restart back-off; the batch folder's environment override."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.supervisor import FIRST_BACKOFF_S, HEALTHY_S, MAX_QUICK_DEATHS, Supervisor, WorkerSlot
from policies.config import ConfigError, parse_config

BASE = """\
model: m
pools:
  - name: p
    max_model_len: 8192
    endpoints: ["http://127.0.0.1:8001"]
"""


def test_one_worker_is_the_default_and_needs_nothing() -> None:
    assert parse_config(BASE, env={}).server.workers == 1


def test_several_workers_need_redis_state() -> None:
    with pytest.raises(ConfigError, match=r"server.workers: 2 needs `state: redis://...`"):
        parse_config(BASE + "server: {workers: 2}\n", env={})
    with pytest.raises(ConfigError, match="needs `state: redis://...`"):
        parse_config(BASE + "server: {workers: 2}\nstate: memory\n", env={})
    config = parse_config(BASE + "server: {workers: 2}\nstate: redis://127.0.0.1:6379/0\n", env={})
    assert config.server.workers == 2
    config = parse_config(BASE + "server: {workers: 2}\n", env={"M3GATE_STATE": "redis://127.0.0.1:6379/0"})
    assert config.state == "redis://127.0.0.1:6379/0"


def test_several_workers_refuse_granian_and_ports_past_65535() -> None:
    with pytest.raises(ConfigError, match="runs uvicorn workers"):
        parse_config(BASE + "server: {workers: 2, listener: granian}\nstate: redis://h:6379/0\n", env={})
    with pytest.raises(ConfigError, match="passes port 65535"):
        parse_config(BASE + "server: {workers: 4, worker_port_base: 65534}\nstate: redis://h:6379/0\n", env={})
    with pytest.raises(ConfigError, match="server.workers"):
        parse_config(BASE + "server: {workers: 0}\n", env={})


def test_the_supervisor_shares_one_batch_folder_through_the_environment() -> None:
    config = parse_config(BASE, env={"M3GATE_BATCH_FILES_DIR": "/tmp/shared-batch"})
    assert config.batch.files_dir == "/tmp/shared-batch"


def test_config_check_explains_the_refusal(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(BASE + "server:\n  workers: 3\n")
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "config", "check", str(path)], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"}, cwd=Path(__file__).parents[2])
    assert out.returncode == 1
    assert "needs `state: redis://...`" in out.stderr


class _Dead:
    """A worker process that has exited with `returncode`."""

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode
        self.pid = 0

    def poll(self) -> int:
        return self.returncode


class _Alive:
    returncode = None
    pid = 0

    def poll(self) -> None:
        return None


def _died(slot: WorkerSlot, started_at: float) -> None:
    slot.proc = _Dead(1)  # type: ignore[assignment]
    slot.started_at = started_at


def test_a_dying_worker_is_restarted_after_a_doubling_back_off_and_given_up_on_at_last() -> None:
    supervisor = Supervisor("pools.yaml", "127.0.0.1", 8080, 1)
    slot = WorkerSlot(0)
    supervisor.slots = [slot]
    now = 1000.0
    waits = []
    for _ in range(MAX_QUICK_DEATHS - 1):
        _died(slot, now - 1.0)
        assert supervisor.reap(now)
        assert slot.proc is None and slot.restart_at is not None
        waits.append(slot.restart_at - now)
    assert waits == [FIRST_BACKOFF_S * 2 ** i for i in range(MAX_QUICK_DEATHS - 1)]
    _died(slot, now - 1.0)
    assert not supervisor.reap(now)  # kept dying at start, and no other worker is up: give up


def test_a_worker_that_keeps_dying_is_retried_while_another_serves() -> None:
    supervisor = Supervisor("pools.yaml", "127.0.0.1", 8080, 2)
    dying, serving = WorkerSlot(0, quick_deaths=MAX_QUICK_DEATHS), WorkerSlot(1)
    serving.proc = _Alive()  # type: ignore[assignment]
    supervisor.slots = [dying, serving]
    _died(dying, 999.0)
    assert supervisor.reap(1000.0) and dying.restart_at is not None


def test_a_worker_that_lived_long_restarts_at_the_first_back_off_and_none_restarts_while_stopping() -> None:
    supervisor = Supervisor("pools.yaml", "127.0.0.1", 8080, 1)
    slot = WorkerSlot(0, backoff_s=16.0, quick_deaths=3)
    supervisor.slots = [slot]
    _died(slot, 0.0)
    assert supervisor.reap(HEALTHY_S + 1.0)
    assert slot.restart_at == HEALTHY_S + 1.0 + FIRST_BACKOFF_S and slot.quick_deaths == 1
    supervisor.stopping = True
    slot.restart_at = None
    _died(slot, 0.0)
    assert supervisor.reap(100.0) and slot.restart_at is None
