"""Start and stop real vLLM CPU servers serving the tiny model, for tests, benchmarks and `make vllm-up`.

Each server is `python -m vllm.entrypoints.openai.api_server` from the separate vLLM virtualenv, in its own process
group (API server, engine core and worker are stopped together), on a free 127.0.0.1 port, logging to a file under
the cache folder. Starting takes about a minute alone and two to three when three start at once on two cores, so
servers are spawned together and awaited together. The calls here block: use them from fixtures, CLIs or
`asyncio.to_thread`, never on an event loop.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pools.vllm_local import paths
from pools.vllm_local.tiny_model import ensure_tiny_model

SERVED_MODEL_NAME = "MiniMaxAI/MiniMax-M3"
BLOCK_SIZE = 128
# The parsers a MiniMax-M3 deployment runs with; vLLM 0.32 accepts them for the tiny Llama because its vocabulary
# holds the <mm:think> markers (see tiny_model.py).
MINIMAX_PARSER_ARGS: tuple[str, ...] = (
    "--reasoning-parser", "minimax_m3",
    "--tool-call-parser", "minimax_m3",
    "--enable-auto-tool-choice",
)  # fmt: skip
DEFAULT_START_TIMEOUT_S = 480.0
_PORT_ATTEMPTS = 3
_LOGS_KEPT = 60


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
        return _tail(self.log_path, lines)


def server_args(
    model_dir: Path, max_model_len: int, port: int, *, parsers: bool = True, extra_args: Sequence[str] = ()
) -> list[str]:
    """The api_server command-line arguments (after `-m vllm.entrypoints.openai.api_server`)."""
    args = [
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--max-model-len", str(max_model_len),
        "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    if parsers:
        args += MINIMAX_PARSER_ARGS
    return args + list(extra_args)


def server_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """1 GiB of KV cache (two million tokens for this model) and no network: nothing may be fetched."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }


def start_servers(
    max_model_lens: Sequence[int],
    *,
    model_dir: Path | None = None,
    parsers: bool = True,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = DEFAULT_START_TIMEOUT_S,
    cancel: threading.Event | None = None,
) -> list[VllmServer]:
    """Start one server per `max_model_len`, all at once, and return them when every one answers /health.

    On any failure every server is stopped and `VllmStartError` (with the failing log's tail) is raised.
    `extra_args` may contain placeholders filled per server: `{port}` (its HTTP port) and `{kv_port}` /
    `{kv_replay_port}` (fresh free ports, e.g. for `kv_events_args()`); `VllmServer.ports` says what they became.
    Setting `cancel` (from another thread) abandons the start: the servers are stopped and `VllmStartError` raised.
    """
    python = paths.vllm_python()
    if not python.exists():
        raise VllmStartError(f"{python} is missing: run `make vllm-env` (scripts/install-vllm.sh) first")
    model_dir = model_dir or ensure_tiny_model()
    paths.log_dir().mkdir(parents=True, exist_ok=True)
    _prune_logs(keep=_LOGS_KEPT)
    pending = [
        _Pending(max_model_len=n, model_dir=model_dir, parsers=parsers, extra_args=tuple(extra_args), env=env)
        for n in max_model_lens
    ]
    try:
        for launch in pending:
            launch.spawn(python)
        _wait_all_healthy(pending, timeout, cancel or threading.Event())
    except BaseException:
        stop_all([launch.server() for launch in pending if launch.proc is not None], timeout=5.0)
        raise
    return [launch.server() for launch in pending]


def start_server(max_model_len: int, **kwargs: object) -> VllmServer:
    """One server; same keywords as `start_servers`."""
    return start_servers([max_model_len], **kwargs)[0]  # type: ignore[arg-type]


@contextlib.contextmanager
def running_servers(max_model_lens: Sequence[int], **kwargs: object) -> Iterator[list[VllmServer]]:
    """Servers that are always stopped on the way out, whatever happened."""
    servers = start_servers(max_model_lens, **kwargs)  # type: ignore[arg-type]
    try:
        yield servers
    finally:
        stop_all(servers)


def stop_all(servers: Sequence[VllmServer], timeout: float = 20.0) -> None:
    """SIGTERM every group first, then wait: stopping three one after another would triple the wait."""
    for server in servers:
        _signal_group(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_group_members(s.pid) for s in servers) and time.monotonic() < deadline:
        time.sleep(0.2)
    for server in servers:
        server.kill()


# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    """A server being started; retried on another port if the one picked was taken meanwhile."""

    max_model_len: int
    model_dir: Path
    parsers: bool
    extra_args: tuple[str, ...]
    env: dict[str, str] | None
    port: int = 0
    ports: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    spawned_at: float = 0.0
    healthy_after: float | None = None
    log_path: Path = Path()
    args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None

    def spawn(self, python: Path) -> None:
        self.attempts += 1
        self.port = _free_port()
        self.ports = {"port": self.port}
        for name in ("kv_port", "kv_replay_port"):
            if any(f"{{{name}}}" in arg for arg in self.extra_args):
                self.ports[name] = _free_port()
        extra = tuple(_fill(arg, self.ports) for arg in self.extra_args)
        self.args = tuple(
            server_args(self.model_dir, self.max_model_len, self.port, parsers=self.parsers, extra_args=extra)
        )
        self.log_path = paths.log_dir() / f"vllm-{self.max_model_len}-{self.port}-{int(time.time())}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(python), "-m", "vllm.entrypoints.openai.api_server", *self.args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(self.env),
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


def _wait_all_healthy(pending: list[_Pending], timeout: float, cancel: threading.Event) -> None:
    python = paths.vllm_python()
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while True:
            waiting = [p for p in pending if p.healthy_after is None]
            if not waiting:
                return
            for launch in waiting:
                assert launch.proc is not None
                if launch.proc.poll() is not None:
                    tail = _tail(launch.log_path, 60)
                    # the whole log of this attempt: the bind error is followed by 60+ lines of shutdown tracebacks
                    if _port_clash(launch.log_path) and launch.attempts < _PORT_ATTEMPTS:
                        _signal_group(launch.proc.pid, signal.SIGKILL)
                        launch.spawn(python)
                        continue
                    raise VllmStartError(
                        f"vLLM (--max-model-len {launch.max_model_len}) exited with rc={launch.proc.returncode} "
                        f"while starting; log {launch.log_path}:\n{tail}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"http://127.0.0.1:{launch.port}/health").status_code == 200:
                        launch.healthy_after = time.monotonic() - launch.spawned_at
            if time.monotonic() > deadline:
                late = next(p for p in pending if p.healthy_after is None)
                raise VllmStartError(
                    f"vLLM (--max-model-len {late.max_model_len}) not healthy after {timeout:.0f}s; "
                    f"log {late.log_path}:\n{_tail(late.log_path, 60)}"
                )
            if cancel.wait(1.0):
                raise VllmStartError("start cancelled")


def kv_events_args(topic: str = "kv") -> list[str]:
    """`--kv-events-config` publishing on 127.0.0.1-reachable ports picked per server (`*` binds; see the contract).

    Subscribe to `tcp://127.0.0.1:{server.ports["kv_port"]}`; replay on `server.ports["kv_replay_port"]`.
    """
    config = (
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{kv_port}",'
        '"replay_endpoint":"tcp://*:{kv_replay_port}","topic":"' + topic + '"}'
    )
    return ["--kv-events-config", config]


def _fill(arg: str, ports: dict[str, int]) -> str:
    for name, value in ports.items():
        arg = arg.replace(f"{{{name}}}", str(value))
    return arg


def _free_port() -> int:
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


def _prune_logs(keep: int) -> None:
    """Every start writes a log; keep the newest few so the cache folder does not grow without bound."""
    def mtime(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # removed meanwhile by another session's prune
            return 0.0

    logs = sorted(paths.log_dir().glob("vllm-*.log"), key=mtime, reverse=True)
    for old in logs[keep:]:
        old.unlink(missing_ok=True)


def _port_clash(path: Path) -> bool:
    """A port the server was given was taken by the time it bound it (each attempt writes its own log)."""
    try:
        return "Address already in use" in path.read_text(errors="replace")
    except OSError:
        return False


def _tail(path: Path, lines: int) -> str:
    """The log's last lines, without pip's index warnings that bury the real error."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    kept = [line for line in text.splitlines() if not line.startswith("WARNING: Location")]
    return "\n".join(kept[-lines:])


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start real vLLM CPU servers with the tiny model until Ctrl-C.")
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--no-parsers", action="store_true", help="omit the minimax_m3 reasoning/tool parsers")
    parser.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT_S)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more api_server arguments for all")
    args = parser.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill PID` must stop the servers too, not orphan them
    print(f"starting {len(args.max_model_len)} vLLM server(s); logs in {paths.log_dir()}", flush=True)
    began = time.monotonic()
    servers = start_servers(args.max_model_len, parsers=not args.no_parsers, extra_args=extra, timeout=args.timeout)
    try:
        print(f"all healthy after {time.monotonic() - began:.0f}s", flush=True)
        for server in servers:
            print(
                f"  {server.url}  max_model_len={server.max_model_len}  pid={server.pid}  "
                f"ready={server.start_seconds:.0f}s  rss={server.rss_bytes() / 2**30:.2f}GiB  log={server.log_path}",
                flush=True,
            )
        print("Ctrl-C stops them.", flush=True)
        while all(server.alive() for server in servers):
            time.sleep(1.0)
        dead = [s for s in servers if not s.alive()]
        print(f"server {dead[0].url} exited; log tail:\n{dead[0].log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all(servers)
        print("stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
