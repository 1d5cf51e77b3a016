"""What the harness reads from and does to processes: replicas' /metrics deltas, /proc CPU and RSS, CPU pinning,
and a simulated pool plus gateway for the benchmarks and the self-test. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MODEL = "MiniMaxAI/MiniMax-M3"
_COUNTERS = {b"vllm:prefix_cache_hits_total": "hits", b"vllm:prefix_cache_queries_total": "queries",
             b"vllm:prompt_tokens_total": "prompt_tokens", b"vllm:generation_tokens_total": "generation_tokens",
             b"vllm:num_preemptions_total": "preemptions"}


def scrape_counters(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Sum of the counters above over all series of a vLLM /metrics page (empty when unreachable)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
            body = resp.read()
    except OSError:
        return {}
    out = dict.fromkeys(_COUNTERS.values(), 0.0)
    for line in body.split(b"\n"):
        if not line or line[0] == 35:  # '#'
            continue
        name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        key = _COUNTERS.get(name)
        if key is not None:
            try:
                out[key] += float(line.rsplit(b" ", 1)[1])
            except (ValueError, IndexError):
                pass
    return out


class MetricsDelta:
    """Counters of every replica before and after a run; `result()` is the prefix-cache hit rate over the run."""

    def __init__(self, replicas: Sequence[str]) -> None:
        self.replicas = list(replicas)
        self.before = {r: scrape_counters(r) for r in self.replicas}

    def result(self) -> dict[str, Any]:
        after = {r: scrape_counters(r) for r in self.replicas}
        per: dict[str, dict[str, float | None]] = {}
        tot: dict[str, float] = {}
        for r in self.replicas:
            a, b = after.get(r) or {}, self.before.get(r) or {}
            d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b)}
            d["rate"] = d["hits"] / d["queries"] if d.get("queries") else None
            per[r] = d
            for k, v in d.items():
                if k != "rate" and v is not None:
                    tot[k] = tot.get(k, 0.0) + v
        queries = tot.get("queries", 0.0)
        return {"rate": tot.get("hits", 0.0) / queries if queries else None, "hits": tot.get("hits", 0.0),
                "queries": queries, "prompt_tokens": tot.get("prompt_tokens", 0.0),
                "generation_tokens": tot.get("generation_tokens", 0.0), "preemptions": tot.get("preemptions", 0.0),
                "per_replica": per}


# ---------------------------------------------------------------------------------------------------------------
# /proc


CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (from /proc/PID/stat), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _schedstat(pid: int) -> list[tuple[int, list[int]]]:
    """(thread id, /proc/PID/task/TID/schedstat's fields) of each live thread: ns on a CPU, ns waiting for one, ..."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out.append((int(tid), [int(field) for field in f.read().split()]))
        except (OSError, ValueError):
            continue
    return out


def thread_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time of a process's main thread and of its other live threads, in seconds, to the nanosecond
    (schedstat; /proc/PID/stat counts in 10 ms ticks). Threads that have exited are not counted: use it for
    processes whose threads live as long as they do."""
    main = others = 0
    for tid, fields in _schedstat(pid):
        if tid == pid:
            main += fields[0]
        else:
            others += fields[0]
    return main / 1e9, others / 1e9


def sched_wait_seconds(pid: int) -> float:
    """Time the process's threads spent runnable but waiting for a CPU (schedstat's second field): how much a shared
    core held it back."""
    return sum(fields[1] for _, fields in _schedstat(pid) if len(fields) > 1) / 1e9


def pin(pid: int, cpus: set[int]) -> bool:
    """Pin a process to CPUs when the machine has them; returns whether it was done."""
    available = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    wanted = cpus & available
    if not wanted:
        return False
    try:
        os.sched_setaffinity(pid, wanted)
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), wanted)
            except OSError:
                pass
        return True
    except OSError:
        return False


def raise_fd_limit(wanted: int = 20000) -> int:
    """Raise RLIMIT_NOFILE toward `wanted` (children inherit it); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(wanted, hard) if hard != resource.RLIM_INFINITY else wanted
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


# ---------------------------------------------------------------------------------------------------------------
# A simulated pool behind a gateway


def gateway_config(endpoints: Sequence[str], *, policy: str = "prefix_affinity", max_model_len: int = 32768,
                   modalities: Sequence[str] = ("text",), kv_blocks: int | None = None,
                   extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    pool: dict[str, Any] = {"name": "bench", "max_model_len": max_model_len, "modalities": list(modalities),
                            "endpoints": list(endpoints)}
    if kv_blocks:
        pool["kv_blocks"] = kv_blocks
    cfg: dict[str, Any] = {
        "model": MODEL,
        "pools": [pool],
        "routing": {"policy": policy},
        "server": {"health_interval_s": 0.5},
        "admin": {"watch_config": False},
    }
    for k, v in (extra or {}).items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, Mapping) and isinstance(cfg.get(k), dict) else v
    return cfg


def bench_config(urls: Sequence[str]) -> dict[str, Any]:
    """A gateway config whose admission never holds a request back (this bench measures the relay, not admission):
    one traffic class with room for every request, and no pool saturation from replicas' queues. Falls back to the
    plain config if this gateway version has no such settings."""
    cfg = gateway_config(urls, policy="prefix_affinity", max_model_len=8192,
                         extra={"server": {"health_interval_s": 2.0}})
    permissive = {**cfg, "traffic": {
        "classes": {"bench": {"priority": 0, "max_concurrency": 100_000, "queue_length": 100_000,
                              "max_queue_wait_s": 600}},
        "saturation": {"max_waiting": None, "max_kv_usage": None}}}
    try:
        from policies.config import GatewayConfig

        GatewayConfig.model_validate(permissive)
        return permissive
    except Exception:  # noqa: BLE001 - an older/newer config model: use the defaults
        return cfg


@dataclass
class SimPool:
    sims: list[Any]  # pools.sim.launcher.SimProcess

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.sims]

    def reset(self) -> None:
        for s in self.sims:
            s.reset()

    def stats(self) -> list[dict[str, Any]]:
        return [s.stats() for s in self.sims]

    def pids(self) -> list[int]:
        return [s.pid for s in self.sims]


@contextmanager
def sim_pool(count: int, max_model_len: int = 32768, extra_args: Sequence[str] = ()) -> Iterator[SimPool]:
    from pools.sim.launcher import running_sims

    with running_sims([{"max_model_len": max_model_len, "extra_args": list(extra_args)} for _ in range(count)]) as s:
        yield SimPool(list(s))


@contextmanager
def gateway(config: Mapping[str, Any], cpus: set[int] | None = None) -> Iterator[Any]:
    """A gateway process (gateway.cli.launcher) for the duration of the block, optionally pinned."""
    from gateway.cli.launcher import start_gateway

    gw = start_gateway(config)
    try:
        if cpus:
            pin(gw.pid, cpus)
        yield gw
    finally:
        gw.stop()


def wait_gateway_sees(gw_url: str, replicas: int, timeout: float = 10.0) -> None:
    """Wait until the gateway's /ready says its pool is up (its monitor has polled the replicas)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(gw_url + "/ready", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)


class GatewayProc:
    """A gateway process on a free loopback port: `m3gate serve`, or `python -m MODULE ARGS... CONFIG PORT` for a
    wrapped one (profiled, or with patched policy parameters), optionally pinned to `cpus`; `cwd`: another checkout's
    gateway (`python -m` imports from it). Stop with stop()."""

    def __init__(self, config: Mapping[str, Any], serve_module: Sequence[str] | None = None,
                 cpus: set[int] | None = None, timeout: float = 30.0, cwd: Path | None = None) -> None:
        from gateway.cli.launcher import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        folder = Path(tempfile.mkdtemp(prefix="m3gate-bench-gw-"))
        self.config_path = folder / "pools.yaml"
        self.config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        self.log_path = folder / "gateway.log"
        if serve_module is None:
            cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(self.config_path), "--host",
                   "127.0.0.1", "--port", str(self.port)]
        else:
            module, *args = serve_module
            cmd = [sys.executable, "-m", module, args[0], str(self.config_path), str(self.port), *args[1:]]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd)
        self.pid = self.proc.pid
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"gateway exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=0.5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gateway did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        if cpus:
            pin(self.pid, cpus)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> GatewayProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
