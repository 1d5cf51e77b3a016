"""Reference proxies run beside m3gate in the overhead bench, so its figures read against what is possible here.

- `floor`: loadtests.floor_proxy, the cheapest relay the design packages allow (uvicorn raw ASGI + aiohttp), i.e.
  the part of m3gate's cost no Python gateway on these packages avoids;
- `floor-granian`, `floor-granian-rsgi`: the same relay on granian (Rust HTTP server) through its ASGI and its RSGI
  interface: the ceiling of each listener stack m3gate could run on; `floor-raw`, `floor-granian-rsgi-raw`: uvicorn /
  granian RSGI with a minimal httptools keep-alive client upstream instead of aiohttp (the client stack's share);
- `sglang-router`: SGLang's Rust router (`sglang-router` from PyPI, round_robin), the cheapest production router
  measured on this kind of machine (../shared/reference/performance.md §6). Installed once into its own virtual
  environment under $M3GATE_CACHE (default ~/.cache/m3gate/peer-venv); skipped with a note where that fails
  (no registry access).

- `m3gate@DIR`: m3gate as checked out in DIR (e.g. `git worktree add /tmp/base <commit>`), with the same config as
  the m3gate under test: an A/B of two versions in the same run (`--peers floor,m3gate@/tmp/base`);
  `m3gate-granian@DIR` the same under granian (M3GATE_LISTENER=granian), e.g. `m3gate-granian@.` for this checkout.

Each runs as its own process on a free loopback port, pinned like the gateway; stop() ends it by PID.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SGLANG_ROUTER = "sglang-router==0.3.2"


def cache_dir() -> Path:
    return Path(os.environ.get("M3GATE_CACHE") or Path.home() / ".cache" / "m3gate")


def sglang_python(install: bool = True, timeout_s: float = 240.0) -> tuple[Path | None, str]:
    """The peer venv's python with sglang-router importable, installing it on first use; (None, why) if not."""
    venv = cache_dir() / "peer-venv"
    python = venv / "bin" / "python"

    def importable() -> bool:
        return python.exists() and subprocess.run([str(python), "-c", "import sglang_router"],
                                                  capture_output=True, timeout=60).returncode == 0

    if importable():
        return python, "cached"
    if not install:
        return None, "not installed"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", SGLANG_ROUTER], capture_output=True,
                              text=True, timeout=timeout_s)
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"install failed: {exc}"
    if done.returncode != 0 or not importable():
        return None, f"install failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
    return python, "installed"


@dataclass
class PeerProcess:
    name: str
    url: str
    pid: int
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_peer(name: str, upstreams: Sequence[str], timeout_s: float = 30.0) -> PeerProcess:
    """Start peer `name` ("floor", "floor-granian", "floor-granian-rsgi", "sglang-router" or "m3gate@DIR") in front of `upstreams`; raises RuntimeError if
    it can't."""
    from gateway.launcher import free_port

    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix=f"m3gate-peer-{name.split('@')[0]}-"))
    log = folder / "peer.log"
    cwd = Path(__file__).resolve().parent.parent
    env = None
    if name.startswith(("m3gate@", "m3gate-granian@")):
        import yaml

        from loadtests.replicas import bench_config

        cwd = Path(name.split("@", 1)[1]).resolve()
        if not (cwd / "gateway" / "cli.py").exists():
            raise RuntimeError(f"{cwd} is not an m3gate checkout")
        config = folder / "pools.yaml"
        config.write_text(yaml.safe_dump(bench_config(upstreams), sort_keys=False))
        env = {**os.environ, "PYTHONPATH": str(cwd)}
        if name.startswith("m3gate-granian@"):
            env["M3GATE_LISTENER"] = "granian"
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--host", "127.0.0.1", "--port",
               str(port)]
    elif name == "floor":
        cmd = [sys.executable, "-m", "loadtests.floor_proxy", str(port), *upstreams]
    elif name in ("floor-granian", "floor-granian-rsgi", "floor-raw", "floor-granian-rsgi-raw"):
        cmd = [sys.executable, "-m", "loadtests.floor_proxy", "--server", name.removeprefix("floor-"), str(port),
               *upstreams]
    elif name == "sglang-router":
        python, why = sglang_python()
        if python is None:
            raise RuntimeError(f"sglang-router unavailable ({why})")
        cmd = [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", "round_robin", "--log-level", "warn", "--log-dir", str(folder), "--worker-urls",
               *upstreams]
    else:
        raise ValueError(f"unknown peer {name!r}")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    peer = PeerProcess(name, f"http://127.0.0.1:{port}", proc.pid, proc, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {log.read_text(errors='replace')[-1500:]}")
        try:
            with urllib.request.urlopen(peer.url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return peer
        except OSError:
            pass
        time.sleep(0.1)
    peer.stop()
    raise RuntimeError(f"{name} did not become healthy in {timeout_s:.0f} s: {log.read_text(errors='replace')[-1500:]}")
