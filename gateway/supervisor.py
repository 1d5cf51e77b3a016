"""`server.workers: N`: N gateway processes on one host:port, each the whole gateway (`m3gate serve --worker I`),
under a small supervisor (this module, the process `m3gate serve` started).

Why SO_REUSEPORT and not one socket bound here and inherited (uvicorn's and gunicorn's `workers`): with one shared
accept queue the kernel wakes the worker that waited last, so under load the busiest worker keeps accepting and the
spread is uneven; with a socket per worker in one SO_REUSEPORT group the kernel hashes each new connection to one
of them, so connections spread evenly. The cost: connections still in a dead worker's accept queue are reset (its
in-flight requests are lost either way). The supervisor binds the address once itself (not listening: it receives
nothing) so that a port in use fails here with a clear message and port 0 resolves to one port for every worker.

The supervisor: forwards SIGTERM / SIGINT to every worker once (each drains through its own lifespan shutdown) and
exits when they have; forwards SIGHUP (each worker reloads the config); restarts a worker that dies, after a
back-off that doubles with each quick death (a worker that lived `HEALTHY_S` starts over at `FIRST_BACKOFF_S`), and
gives up only when one keeps dying at start (`MAX_QUICK_DEATHS`) while no other is up: a config edit that breaks
start-up must not take down the workers still serving. Workers run in their own process group, so a terminal's
Ctrl-C reaches them through the supervisor only (uvicorn force-exits on a second SIGINT), and ask the kernel for a
SIGTERM if the supervisor dies (prctl PDEATHSIG; `m3gate serve --worker`).

With the Batch API on and no `batch.files_dir`, the supervisor makes the one temporary folder every worker keeps
its files and SQLite store in (M3GATE_BATCH_FILES_DIR), and removes it when it exits: a batch created through one
worker is read and run through any (the store's leases give each job to one worker's runner).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.config import GatewayConfig

log = logging.getLogger("m3gate.supervisor")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
HEALTHY_S = 30.0  # a worker that lived this long is healthy: its next death restarts at FIRST_BACKOFF_S
MAX_QUICK_DEATHS = 6  # a worker that died this many times in a row, each within HEALTHY_S: give up
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port in an SO_REUSEPORT group (the supervisor's, not listening; each worker's,
    listening)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class WorkerSlot:
    """Worker `index`: its process now, and when it may be started again after dying."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    backoff_s: float = FIRST_BACKOFF_S
    quick_deaths: int = 0
    restart_at: float | None = None


@dataclass
class Supervisor:
    """Starts `workers` copies of `m3gate serve --worker I` on host:port and keeps them running until a signal."""

    config_path: str
    host: str
    port: int
    workers: int
    env: dict[str, str] = field(default_factory=dict)
    slots: list[WorkerSlot] = field(default_factory=list)
    stopping: bool = False

    def command(self, index: int) -> list[str]:
        return [sys.executable, "-m", "gateway.cli", "serve", "--config", self.config_path, "--host", self.host,
                "--port", str(self.port), "--worker", str(index)]

    def start(self, slot: WorkerSlot) -> None:
        slot.proc = subprocess.Popen(self.command(slot.index), env={**os.environ, **self.env}, process_group=0)
        slot.started_at = time.monotonic()
        slot.restart_at = None
        log.info("worker %d started (pid %d)", slot.index, slot.proc.pid)

    def forward(self, sig: int) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.send_signal(sig)

    def reap(self, now: float) -> bool:
        """Notes workers that exited and schedules their restart; False when one keeps dying at start."""
        for slot in self.slots:
            if slot.proc is None or slot.proc.poll() is None:
                continue
            code, lived = slot.proc.returncode, now - slot.started_at
            slot.proc = None
            if self.stopping:
                continue
            if lived >= HEALTHY_S:
                slot.backoff_s, slot.quick_deaths = FIRST_BACKOFF_S, 0
            slot.quick_deaths += 1
            serving = any(other.proc is not None and other.proc.poll() is None for other in self.slots)
            if slot.quick_deaths >= MAX_QUICK_DEATHS and not serving:
                log.error("worker %d exited with %s %d times in a row, each within %g s, and no worker is up: "
                          "giving up", slot.index, code, slot.quick_deaths, HEALTHY_S)
                return False
            slot.restart_at = now + slot.backoff_s
            log.warning("worker %d exited with %s after %.1f s; restarting in %.1f s", slot.index, code, lived,
                        slot.backoff_s)
            slot.backoff_s = min(MAX_BACKOFF_S, slot.backoff_s * 2)
        return True

    def run(self) -> int:
        """Until SIGTERM / SIGINT and every worker's exit: 0; 1 when a worker kept dying at start."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        received: list[int] = []
        previous = {sig: signal.signal(sig, lambda s, _f: received.append(s)) for sig in (*FORWARDED, signal.SIGCHLD)}
        old_wakeup = signal.set_wakeup_fd(wake_w)
        self.slots = [WorkerSlot(i) for i in range(self.workers)]
        ok = True
        try:
            for slot in self.slots:
                self.start(slot)
            while self.stopping is False or any(s.proc is not None for s in self.slots):
                now = time.monotonic()
                pending = [s.restart_at for s in self.slots if s.restart_at is not None]
                timeout = max(0.0, min(pending) - now) if pending else 5.0
                if not received:
                    select.select([wake_r], [], [], timeout)
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)  # the wake-up bytes (none when the wake was the timeout)
                while received:
                    sig = received.pop(0)
                    if sig in (signal.SIGTERM, signal.SIGINT):
                        if not self.stopping:
                            log.info("%s: stopping %d workers", signal.Signals(sig).name, self.workers)
                        self.stopping = True
                        for slot in self.slots:
                            slot.restart_at = None
                    if sig != signal.SIGCHLD:
                        self.forward(sig)
                now = time.monotonic()
                if not self.reap(now):
                    ok = False
                    self.stopping = True
                    self.forward(signal.SIGTERM)
                if self.stopping:
                    continue
                for slot in self.slots:
                    if slot.proc is None and slot.restart_at is not None and now >= slot.restart_at:
                        self.start(slot)
        finally:
            for slot in self.slots:  # only on an error here: the workers must not outlive their supervisor
                if slot.proc is not None and slot.proc.poll() is None:
                    slot.proc.kill()
                    slot.proc.wait()
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(wake_r)
            os.close(wake_w)
        return 0 if ok else 1


def supervise(config: GatewayConfig, config_path: str, host: str, port: int) -> int:
    """`m3gate serve` with server.workers > 1: check the address, share the batch folder, run the workers."""
    workers = config.server.workers
    try:
        probe = reuse_port_socket(host, port)
    except OSError as exc:
        print(f"cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    port = probe.getsockname()[1]
    env: dict[str, str] = {}
    batch_dir = None
    if config.batch.enabled and not config.batch.files_dir:
        batch_dir = tempfile.mkdtemp(prefix="m3gate-batch-")
        env["M3GATE_BATCH_FILES_DIR"] = batch_dir
    log.info("m3gate: %d workers on %s:%d", workers, host, port)
    try:
        return Supervisor(config_path, host, port, workers, env).run()
    finally:
        probe.close()
        if batch_dir is not None:
            shutil.rmtree(batch_dir, ignore_errors=True)


def prepare_worker() -> None:
    """Ask Linux to SIGTERM this worker when its supervisor dies (even by SIGKILL): no orphaned workers holding the
    port; no effect elsewhere. And ignore SIGHUP until the app's own handler (a reload) is installed: a reload asked
    while this worker starts must not end it."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def worker_sockets(host: str, port: int, index: int, worker_port_base: int | None,
                   backlog: int = 2048) -> Sequence[socket.socket]:
    """Worker `index`'s listening sockets: the shared port (SO_REUSEPORT) and, with `worker_port_base`, its own."""
    shared = reuse_port_socket(host, port)
    sockets = [shared]
    if worker_port_base is not None:
        own = socket.socket(shared.family, socket.SOCK_STREAM)
        own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        own.bind((host, worker_port_base + index))
        sockets.append(own)
    for sock in sockets:
        sock.listen(backlog)
        sock.set_inheritable(False)
    return sockets
