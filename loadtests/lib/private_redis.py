"""A throwaway `redis-server` for the chaos suite and for tests that stop and restart Redis.

It listens on a free loopback port (never the machine's shared Redis on 6379), keeps nothing on disk, and is stopped
by PID. The port stays fixed across stop/start, so a restarted server comes back at the same address.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import redis

from gateway.cli.launcher import free_port


class PrivateRedis:
    """No persistence, loopback only, on a fixed port so it can be restarted at the same address; stopped by PID."""

    def __init__(self, port: int | None = None, password: str | None = None, db: int = 0) -> None:
        self.port = port or free_port()
        self.password = password
        self.db = db
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{self.db}"

    def start(self, timeout: float = 10.0) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (make redis installs it)")
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--daemonize", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ping():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.3) as s:
                if self.password:
                    s.sendall(f"AUTH {self.password}\r\n".encode())
                    s.recv(64)
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def client(self) -> redis.Redis:
        """A redis-py client on this server's database."""
        return redis.Redis(port=self.port, db=self.db, password=self.password, socket_connect_timeout=0.5)
