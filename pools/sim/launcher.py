"""Start simulated replicas as subprocesses, for tests and tools.

Each replica listens on a port it picks itself (`--port 0`) and reports it, so parallel test runs never race for
"free" ports. `stop()` is idempotent and escalates to SIGKILL; always use it (or `running_sims`) in a `finally`.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

READY_PREFIX = "m3gate-sim listening on "  # printed by pools.sim.server


@dataclass
class SimProcess:
    url: str  # "http://127.0.0.1:PORT"
    port: int
    pid: int
    log_path: str = ""
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 3 s; idempotent."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._forget_log()

    def kill(self) -> None:
        """SIGKILL now (chaos tests: a replica that dies without closing anything)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._forget_log()

    def _forget_log(self) -> None:
        """Remove the stderr log once the process is gone, unless M3GATE_KEEP_SIM_LOGS is set."""
        if self.log_path and not os.environ.get("M3GATE_KEEP_SIM_LOGS"):
            try:
                os.unlink(self.log_path)
            except OSError:
                pass
            self.log_path = ""

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log(self) -> str:
        """The replica's stderr so far (for assertion messages)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def set_faults(self, **faults: Any) -> dict[str, Any]:
        """POST /sim/faults with these fields (error_rate, added_latency_ms, hang, drop_mid_stream,
        refuse_connections, refuse_for_s, unhealthy); returns the faults now in force."""
        return _http_json(f"{self.url}/sim/faults", faults)

    def stats(self) -> dict[str, Any]:
        """GET /sim/stats."""
        return _http_json(f"{self.url}/sim/stats")

    def reset(self) -> dict[str, Any]:
        """POST /sim/reset: clear the prefix cache and counters."""
        return _http_json(f"{self.url}/sim/reset", {})


def _http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _read_ready_line(proc: subprocess.Popen[bytes], deadline: float) -> str | None:
    assert proc.stdout is not None
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=min(0.2, max(0.0, deadline - time.monotonic()))):
                if proc.poll() is not None:
                    return None
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            buf += chunk
            if b"\n" in buf:
                return buf.split(b"\n", 1)[0].decode(errors="replace")
    return None


def _healthy(url: str, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0) as resp:
                if resp.status in (200, 503):  # 503 = started with --fault-unhealthy, still up
                    return True
        except urllib.error.HTTPError as exc:
            if exc.code == 503:
                return True
        except OSError:
            pass
        time.sleep(0.02)
    return False


def start_sim(max_model_len: int, *, model: str = "MiniMaxAI/MiniMax-M3", extra_args: Sequence[str] = (),
              port: int | None = None, env: Mapping[str, str] | None = None, timeout: float = 60.0) -> SimProcess:
    """Run `python -m pools.sim` on 127.0.0.1 (a free port unless `port` is given) and wait until it answers."""
    cmd = [sys.executable, "-m", "pools.sim", "--host", "127.0.0.1", "--port", str(port or 0),
           "--max-model-len", str(max_model_len), "--model", model, *extra_args]
    log = tempfile.NamedTemporaryFile(prefix="m3gate-sim-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})
    log.close()
    sim = SimProcess(url="", port=0, pid=proc.pid, log_path=log.name, _proc=proc)
    deadline = time.monotonic() + timeout
    try:
        line = _read_ready_line(proc, deadline)
        if line is None or not line.startswith(READY_PREFIX):
            raise RuntimeError(f"simulator did not start ({' '.join(cmd)}):\n{sim.log()[-3000:]}")
        sim.url = line[len(READY_PREFIX):].strip()
        sim.port = int(sim.url.rsplit(":", 1)[1])
        refusing = "--fault-refuse-connections" in extra_args
        if not refusing and not _healthy(sim.url, deadline):
            raise RuntimeError(f"simulator at {sim.url} never became healthy:\n{sim.log()[-3000:]}")
    except BaseException:
        sim.kill()  # the RuntimeErrors above already carry the log
        raise
    finally:
        if proc.stdout is not None:
            proc.stdout.close()
    return sim


@contextmanager
def running_sims(specs: Sequence[dict[str, Any]]) -> Iterator[list[SimProcess]]:
    """Start one replica per spec (kwargs of `start_sim`) in parallel; stop them all on exit."""
    started: list[SimProcess] = []
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
        futures = [pool.submit(start_sim, **spec) for spec in specs]
        for fut in futures:
            try:
                started.append(fut.result())
            except BaseException as exc:  # noqa: BLE001 - reported after the others are stopped
                errors.append(exc)
    try:
        if errors:
            raise errors[0]
        yield started
    finally:
        for sim in started:
            sim.stop()
