"""Spawning vLLM api_server processes, waiting until they answer /health, and stopping them: shared by the single
servers of launcher.py and the prefill/decode pair of pd.py.

Each server runs in its own process group (API server, engine core and worker are stopped together), on free
127.0.0.1 ports picked per start, logging to a file under the cache folder. Servers are spawned together and awaited
together (one start takes about a minute alone, two to three when three start at once on two cores); a server whose
port was taken meanwhile is respawned on fresh ones. The calls here block: use them from fixtures, CLIs or
`asyncio.to_thread`, never on an event loop.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pools.vllm_local import paths

__all__ = [
    "Command",
    "PendingServer",
    "VllmServer",
    "VllmStartError",
    "free_port",
    "prune_logs",
    "raise_interrupt",
    "start_together",
    "stop_all",
]

LOGS_KEPT = 60
_PORT_ATTEMPTS = 3

# The api_server arguments and the process's whole environment for one start, given the ports picked for it ("port"
# and the names the server asked for).
Command = Callable[[Mapping[str, int]], tuple[tuple[str, ...], dict[str, str]]]


class VllmStartError(RuntimeError):
    """A server did not become healthy; the message carries the tail of its log."""


@dataclass
class VllmServer:
    """One running server. `pid` leads its process group."""

    url: str
    port: int
    pid: int
    max_model_len: int
    model_dir: Path
    log_path: Path
    args: tuple[str, ...]
    start_seconds: float = 0.0
    ports: dict[str, int] = field(default_factory=dict)  # placeholder name -> port, e.g. {"kv_port": 41234}
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the whole group (vLLM shuts its engine down cleanly), SIGKILL what is left after `timeout`."""
        stop_all([self], timeout=timeout)

    def kill(self) -> None:
        _signal_group(self.pid, signal.SIGKILL)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)

    def rss_bytes(self) -> int:
        """Resident memory of every process of the server (shared pages are counted once per process)."""
        total = 0
        for pid in _group_members(self.pid):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def log_tail(self, lines: int = 60) -> str:
        return tail(self.log_path, lines)


@dataclass
class PendingServer:
    """A server being started: `command` says its arguments and environment for the ports picked at each spawn."""

    python: Path
    max_model_len: int
    model_dir: Path
    command: Command
    port_names: tuple[str, ...] = ()  # ports to pick besides "port" (the HTTP one)
    env: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    spawned_at: float = 0.0
    healthy_after: float | None = None
    log_path: Path = Path()
    args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return self.ports["port"]

    def spawn(self) -> None:
        self.attempts += 1
        self.ports = {name: free_port() for name in ("port", *self.port_names)}
        self.args, self.env = self.command(self.ports)
        self.log_path = paths.log_dir() / f"vllm-{self.max_model_len}-{self.port}-{int(time.time())}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(self.python), "-m", "vllm.entrypoints.openai.api_server", *self.args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=paths.cache_dir(),
                start_new_session=True,  # its own process group, so the engine and worker stop with it
            )
        self.spawned_at = time.monotonic()

    def server(self) -> VllmServer:
        assert self.proc is not None
        return VllmServer(
            url=f"http://127.0.0.1:{self.port}",
            port=self.port,
            pid=self.proc.pid,
            max_model_len=self.max_model_len,
            model_dir=self.model_dir,
            log_path=self.log_path,
            args=self.args,
            start_seconds=self.healthy_after or 0.0,
            ports=dict(self.ports),
            _proc=self.proc,
        )


def start_together(pending: Sequence[PendingServer], timeout: float, cancel: threading.Event | None = None
                   ) -> list[VllmServer]:
    """Spawn every server, then wait until each answers /health. On any failure (or `cancel` set from another
    thread) every one spawned is stopped and `VllmStartError` raised."""
    paths.log_dir().mkdir(parents=True, exist_ok=True)
    prune_logs(keep=LOGS_KEPT)
    try:
        for launch in pending:
            launch.spawn()
        _wait_all_healthy(pending, timeout, cancel or threading.Event())
    except BaseException:
        stop_all([launch.server() for launch in pending if launch.proc is not None], timeout=5.0)
        raise
    return [launch.server() for launch in pending]


def _wait_all_healthy(pending: Sequence[PendingServer], timeout: float, cancel: threading.Event) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while True:
            waiting = [p for p in pending if p.healthy_after is None]
            if not waiting:
                return
            for launch in waiting:
                assert launch.proc is not None
                if launch.proc.poll() is not None:
                    # the whole log of this attempt: the bind error is followed by 60+ lines of shutdown tracebacks
                    if port_clash(launch.log_path) and launch.attempts < _PORT_ATTEMPTS:
                        _signal_group(launch.proc.pid, signal.SIGKILL)
                        launch.spawn()
                        continue
                    raise VllmStartError(
                        f"vLLM (--max-model-len {launch.max_model_len}) exited with rc={launch.proc.returncode} "
                        f"while starting; log {launch.log_path}:\n{tail(launch.log_path, 60)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"http://127.0.0.1:{launch.port}/health").status_code == 200:
                        launch.healthy_after = time.monotonic() - launch.spawned_at
            if time.monotonic() > deadline:
                late = next(p for p in pending if p.healthy_after is None)
                raise VllmStartError(
                    f"vLLM (--max-model-len {late.max_model_len}) not healthy after {timeout:.0f}s; "
                    f"log {late.log_path}:\n{tail(late.log_path, 60)}"
                )
            if cancel.wait(1.0):
                raise VllmStartError("start cancelled")


def stop_all(servers: Sequence[VllmServer], timeout: float = 20.0) -> None:
    """SIGTERM every group first, then wait: stopping three one after another would triple the wait."""
    for server in servers:
        _signal_group(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_group_members(s.pid) for s in servers) and time.monotonic() < deadline:
        time.sleep(0.2)
    for server in servers:
        server.kill()


def free_port() -> int:
    """A port free now, chosen BELOW the kernel's ephemeral range (32768+): a server binds it a minute or two later,
    and in between every outgoing connection on the machine takes ephemeral ports, so one from that range is often
    gone by then ("Address already in use")."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def prune_logs(keep: int) -> None:
    """Every start writes a log; keep the newest few so the cache folder does not grow without bound."""
    def mtime(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # removed meanwhile by another session's prune
            return 0.0

    logs = sorted(paths.log_dir().glob("vllm-*.log"), key=mtime, reverse=True)
    for old in logs[keep:]:
        old.unlink(missing_ok=True)


def port_clash(path: Path) -> bool:
    """A port the server was given was taken by the time it bound it (each attempt writes its own log)."""
    try:
        return "Address already in use" in path.read_text(errors="replace")
    except OSError:
        return False


def tail(path: Path, lines: int) -> str:
    """The log's last lines, without pip's index warnings that bury the real error."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    kept = [line for line in text.splitlines() if not line.startswith("WARNING: Location")]
    return "\n".join(kept[-lines:])


def raise_interrupt(signum: int, frame: object) -> None:
    """A SIGTERM handler: `kill PID` stops the servers too (through the KeyboardInterrupt path), never orphans them."""
    raise KeyboardInterrupt
