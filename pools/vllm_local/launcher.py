"""Start and stop real vLLM CPU servers serving the tiny model, for tests, benchmarks and `make vllm-up`.

Each server is `python -m vllm.entrypoints.openai.api_server` from the separate vLLM virtualenv, on free 127.0.0.1
ports, started, awaited and stopped by processes.py. The calls here block: use them from fixtures, CLIs or
`asyncio.to_thread`, never on an event loop.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from pools.vllm_local import paths
from pools.vllm_local.processes import (
    Command,
    PendingServer,
    VllmServer,
    VllmStartError,
    raise_interrupt,
    start_together,
    stop_all,
)
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
    folder = model_dir or ensure_tiny_model()
    placeholders = tuple(name for name in ("kv_port", "kv_replay_port")
                         if any(f"{{{name}}}" in arg for arg in extra_args))

    def command_for(max_model_len: int) -> Command:
        def command(ports: Mapping[str, int]) -> tuple[tuple[str, ...], dict[str, str]]:
            filled = [fill_ports(arg, ports) for arg in extra_args]
            args = server_args(folder, max_model_len, ports["port"], parsers=parsers, extra_args=filled)
            return tuple(args), server_env(env)
        return command

    pending = [PendingServer(python, n, folder, command_for(n), placeholders) for n in max_model_lens]
    return start_together(pending, timeout, cancel)


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


def kv_events_args(topic: str = "kv") -> list[str]:
    """`--kv-events-config` publishing on 127.0.0.1-reachable ports picked per server (`*` binds; see the contract).

    Subscribe to `tcp://127.0.0.1:{server.ports["kv_port"]}`; replay on `server.ports["kv_replay_port"]`.
    """
    config = (
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{kv_port}",'
        '"replay_endpoint":"tcp://*:{kv_replay_port}","topic":"' + topic + '"}'
    )
    return ["--kv-events-config", config]


def fill_ports(arg: str, ports: Mapping[str, int]) -> str:
    """`arg` with each `{name}` placeholder replaced by the port picked for it."""
    for name, value in ports.items():
        arg = arg.replace(f"{{{name}}}", str(value))
    return arg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start real vLLM CPU servers with the tiny model until Ctrl-C.")
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--no-parsers", action="store_true", help="omit the minimax_m3 reasoning/tool parsers")
    parser.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT_S)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more api_server arguments for all")
    args = parser.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    signal.signal(signal.SIGTERM, raise_interrupt)  # `kill PID` must stop the servers too, not orphan them
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
