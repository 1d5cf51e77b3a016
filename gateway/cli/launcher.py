"""Start a gateway as a child process on a free loopback port (tests, loadtests, chaos suites).

A real process over real HTTP: the same code path users run, with its own event loop and CPU accounting.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def consecutive_free_ports(count: int) -> int:
    """A port p with p + 1 ... p + count - 1 free too (`server.worker_port_base`: each worker's own port)."""
    for _ in range(100):
        first = free_port()
        if first + count - 1 > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                held.append(socket.socket())
                held[-1].bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def child_pids(pid: int) -> set[int]:
    """The processes `pid` started (a supervisor's workers); empty when it has none or is gone."""
    try:
        return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


@dataclass
class GatewayProcess:
    url: str
    port: int
    pid: int
    config_path: Path
    log_path: Path
    _proc: subprocess.Popen[bytes] = field(repr=False)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def write_config(self, config: Mapping[str, Any]) -> None:
        """Replace the config file in place (atomically), e.g. to test hot reload."""
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        os.replace(tmp, self.config_path)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; never raises (a machine stalled for tens of seconds must not turn
        a test's real failure into a TimeoutExpired from its cleanup)."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                try:
                    self._proc.wait(60)
                except subprocess.TimeoutExpired:
                    pass

    def diagnostics(self) -> str:
        """What to read when the gateway did not come up: its process state and the machine's load and memory."""
        lines = []
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
            lines += [line for line in status.splitlines() if line.startswith(("State", "VmRSS", "Threads"))]
            lines.append("wchan: " + Path(f"/proc/{self.pid}/wchan").read_text())
        except OSError:
            lines.append(f"process {self.pid}: gone (exit {self._proc.poll()})")
        try:
            lines.append("loadavg: " + Path("/proc/loadavg").read_text().strip())
            meminfo = Path("/proc/meminfo").read_text().splitlines()
            lines += [line for line in meminfo if line.startswith(("MemTotal", "MemAvailable"))]
        except OSError:
            pass
        return "\n".join(lines)


def start_gateway(
    config: Mapping[str, Any],
    *,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,  # generous: a loaded CI machine can take long to import and start
    workdir: str | Path | None = None,
) -> GatewayProcess:
    """Write `config` to a temp file, run `m3gate serve` on it, and wait until /health answers."""
    port = port or free_port()
    folder = Path(workdir or tempfile.mkdtemp(prefix="m3gate-gw-"))
    config_path = folder / "pools.yaml"
    config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    log_path = folder / f"gateway-{port}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path), "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )
    gw = GatewayProcess(f"http://127.0.0.1:{port}", port, proc.pid, config_path, log_path, proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}:\n{gw.log_tail()}")
        try:
            if httpx.get(gw.url + "/health", timeout=0.5).status_code == 200:
                return gw
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    state = gw.diagnostics()
    gw.stop()
    raise RuntimeError(f"gateway did not become healthy in {timeout}s:\n{state}\nlog:\n{gw.log_tail()}")
