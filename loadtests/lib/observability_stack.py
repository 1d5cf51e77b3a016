"""A short, real observability stack: simulated pools, one gateway, and a real Prometheus scraping both every second
with the alert rules of deploy/prometheus/ loaded; plus the load that gives every dashboard panel and every alert
something to show.

The pools are chosen so that each signal the dashboards and alerts watch actually happens in a few seconds:
`interactive` has a replica that fails 30% of requests (retries, ejections) and one that answers after 3 s (TTFT over
target); `long` has a KV cache that two concurrent long prompts fill past 90% (KV alert, waiting requests); `flaky`
fails half its requests with no second replica (5xx ratio); `dead` has a replica that is not running (no healthy
replica, scrape target down); `agent` takes agent sessions (tool loops with tool waits and think time, half of them
naming their session in a header and ending it with `x-dynamo-session-final`, half found by tool-call ids and
history and ended by a short idle timeout) for the session series; `precise` routes from its replicas' KV events (`precise:` on, the tiny test tokenizer)
where one replica publishes them and the other does not (exact scorings, index freshness, event counters, and
fallbacks to the estimate). The shared-state Redis URL points at a closed port (Redis down), and Prometheus also
scrapes a gateway address where nothing listens (gateway down).

Used by tests/integration/test_prometheus.py and loadtests/assets/render_dashboards.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import shutil
import signal
import socket
import string
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.cli.launcher import GatewayProcess, free_port, start_gateway
from pools.sim.launcher import SimProcess, running_sims

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "m3gate.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
MODEL = "MiniMaxAI/MiniMax-M3"
DEPLOY_GATEWAY = "m3gate:8080"  # the gateway address deploy/prometheus/prometheus.yml is written for

# pool → (max_model_len, one `start_sim` extra_args per replica)
POOLS: dict[str, tuple[int, list[list[str]]]] = {
    "interactive": (4096, [["--speed", "5", "--fault-error-rate", "0.3"],
                           ["--speed", "5", "--fault-added-latency-ms", "3000"]]),
    "long": (8192, [["--kv-blocks", "64", "--mean-output-tokens", "0"]]),
    "flaky": (16384, [["--speed", "5", "--fault-error-rate", "0.5"]]),
    # agent sessions (the `_agent` worker, forced): the largest pool, so nothing else lands or spills there
    "agent": (131072, [["--speed", "5", "--mean-output-tokens", "8"]]),
}
DEAD_POOL = ("dead", 32768)
TRACED_POOL = "interactive"  # its replicas export llm_request spans to the gateway (m3gate_engine_*_seconds)
TRACING_SIM_ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "500"}
# The precise pool: the largest, so nothing spills into it; only the `_precise` worker's requests (forced) go there.
# Its first replica publishes KV events as vLLM does, the second does not (its scorings fall back: `no_events`).
PRECISE_POOL = ("precise", 65536)
KV_EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
                        "replay_endpoint": "tcp://*:0", "topic": "kv"})


def precise_sims(tokenizer_dir: Path) -> list[list[str]]:
    """`start_sim` extra_args of the precise pool's two replicas (both tokenize like the gateway does)."""
    common = ["--speed", "5", "--tokenizer", str(tokenizer_dir), "--prefix-caching-hash-algo", "sha256_cbor",
              "--mean-output-tokens", "0"]
    return [[*common, "--kv-events-config", KV_EVENTS], common]


# ----------------------------------------------------------------------------------------------------------------
# The expressions to check: dashboard panels, template variables, alert rules


@dataclass(frozen=True)
class PanelQuery:
    row: str
    panel: str
    unit: str
    expr: str
    legend: str


def dashboard_queries(path: Path = DASHBOARD) -> list[PanelQuery]:
    """Every target of every panel, in dashboard order, with the row it sits in."""
    dash = json.loads(path.read_text())
    out: list[PanelQuery] = []
    row = ""

    def visit(panels: list[dict[str, Any]]) -> None:
        nonlocal row
        for panel in panels:
            if panel.get("type") == "row":
                row = panel.get("title", "")
                visit(panel.get("panels") or [])  # a collapsed row keeps its panels inside
                continue
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
            for target in panel.get("targets") or []:
                if target.get("expr"):
                    out.append(PanelQuery(row, panel["title"], unit, target["expr"], target.get("legendFormat", "")))

    visit(dash.get("panels") or [])
    return out


def template_queries(path: Path = DASHBOARD) -> list[str]:
    """The series behind the dashboard's query variables: `label_values(SERIES, label)` → SERIES."""
    dash = json.loads(path.read_text())
    out = []
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var.get("query"), dict) else var.get("query", "")
        match = re.fullmatch(r"\s*label_values\((.+),\s*\w+\)\s*", query)
        if match is None:
            raise ValueError(f"template variable {var['name']}: unsupported query {query!r}")
        out.append(match.group(1))
    return out


def alert_rules(rules_dir: Path = RULES_DIR) -> list[tuple[str, str]]:
    """(alert name, expression) of every alerting rule."""
    out = []
    for path in sorted(rules_dir.glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    out.append((rule["alert"], rule["expr"]))
    return out


def concrete(expr: str, rate_interval: str = "10s") -> str:
    """A dashboard expression as Grafana would send it with every variable on "All"."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__interval", "1s")
    return re.sub(r"\$\{?(pool|class)\}?", ".*", expr)


# ----------------------------------------------------------------------------------------------------------------
# Prometheus


class Prometheus:
    """A Prometheus server on a free loopback port with its own config and data dir; stopped by PID."""

    def __init__(self, config: dict[str, Any], workdir: Path, timeout: float = 20.0) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed: run scripts/install-prometheus.sh (or `make prometheus`)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        self.pid = self._proc.pid
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus not ready in {timeout}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def api(self, path: str, **params: Any) -> Any:
        resp = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = resp.json()
        if body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)


class PromQLError(Exception):
    pass


def finite_points(result: list[dict[str, Any]]) -> int:
    """Samples that are numbers (a ratio over an idle window is NaN: no line on a panel)."""
    return sum(1 for series in result for _, v in series.get("values", []) if math.isfinite(float(v)))


def prometheus_config(gateway: str, down_gateway: str, interval: str = "1s") -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml aimed at this stack: same jobs and discovery, a 1 s cadence."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text().replace(DEPLOY_GATEWAY, gateway))
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
    config["rule_files"] = [str(RULES_DIR / "*.yml")]
    for job in config["scrape_configs"]:
        for sd in job.get("http_sd_configs", []):
            sd["refresh_interval"] = "1s"
        if job["job_name"] == "m3gate":
            job["static_configs"][0]["targets"].append(down_gateway)
    return config


# ----------------------------------------------------------------------------------------------------------------
# The stack


@dataclass
class Stack:
    gateway: GatewayProcess
    sims: dict[str, list[SimProcess]]
    dead_replica: str
    prometheus: Prometheus
    workdir: Path


def closed_port() -> int:
    """A loopback port with nothing listening (bound and released: refused until someone else takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def observability_stack(workdir: Path) -> Iterator[Stack]:
    """Sims, gateway and Prometheus, all stopped by PID on exit."""
    from pools.vllm_local.tiny_model import ensure_tiny_tokenizer

    tokenizer_dir = ensure_tiny_tokenizer()
    precise_name, precise_len = PRECISE_POOL
    specs = [(pool, max_len, args) for pool, (max_len, replicas) in POOLS.items() for args in replicas]
    specs += [(precise_name, precise_len, args) for args in precise_sims(tokenizer_dir)]
    gateway_port = free_port()
    # the interactive pool's replicas trace as vLLM does, to the gateway's receiver (the engine stage split);
    # the other pools' do not, and keep only the gateway's combined prefill stage
    tracing_sim = ["--otlp-traces-endpoint", f"http://127.0.0.1:{gateway_port}/v1/traces"]
    sim_specs = [{"max_model_len": m, "extra_args": [*a, *tracing_sim], "env": TRACING_SIM_ENV} if pool == TRACED_POOL
                 else {"max_model_len": m, "extra_args": a} for pool, m, a in specs]
    with ExitStack() as stack, running_sims(sim_specs) as procs:
        sims: dict[str, list[SimProcess]] = {}
        for (pool, _, _), proc in zip(specs, procs, strict=True):
            sims.setdefault(pool, []).append(proc)
        dead = f"http://127.0.0.1:{closed_port()}"
        pools: list[dict[str, Any]] = [
            {"name": name, "max_model_len": max_len, "endpoints": [s.url for s in sims[name]]}
            for name, (max_len, _) in POOLS.items()]
        pools.append({"name": DEAD_POOL[0], "max_model_len": DEAD_POOL[1], "endpoints": [dead]})
        pools.append({"name": precise_name, "max_model_len": precise_len,
                      "endpoints": [s.url for s in sims[precise_name]], "precise": {"model_dir": str(tokenizer_dir)}})
        (workdir / "gateway").mkdir(parents=True, exist_ok=True)
        gateway = start_gateway({
            "model": MODEL,
            "pools": pools,
            "routing": {"policy": "prefix_affinity"},
            "server": {"health_interval_s": 0.5, "upstream_read_timeout_s": 30},
            "admin": {"watch_config": False},
            "state": f"redis://127.0.0.1:{closed_port()}/0",
            "sessions": {"idle_timeout_s": 2.0},  # headerless agent sessions end (by idle) within the run
            "telemetry": {"tracing": {"enabled": True, "exporter": "discard", "sample_ratio": 1.0,
                                      "receive_engine_spans": True}},
        }, port=gateway_port, workdir=workdir / "gateway")
        stack.callback(gateway.stop)
        prometheus = Prometheus(
            prometheus_config(f"127.0.0.1:{gateway.port}", f"127.0.0.1:{closed_port()}"), workdir / "prometheus")
        stack.callback(prometheus.stop)
        yield Stack(gateway, sims, dead, prometheus, workdir)


# ----------------------------------------------------------------------------------------------------------------
# Load


def _words(rnd: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        word = "".join(rnd.choices(string.ascii_lowercase, k=rnd.randint(3, 8)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


_RND = random.Random(7)
SYSTEM_PROMPTS = [f"You are agent {i}. " + _words(_RND, 2400) for i in range(3)]  # ~600 tokens: cacheable blocks
LONG_TEXT = _words(_RND, 15500)  # ~3900 simulator tokens (31 blocks of 128): two in flight fill 64 KV blocks past 95%
MODES = ("enabled", "adaptive", "disabled")


async def _chat(client: httpx.AsyncClient, i: int) -> str:
    body = {"model": MODEL, "max_tokens": 24, "stream": i % 4 != 3,
            "messages": [{"role": "system", "content": SYSTEM_PROMPTS[i % 3]},
                         {"role": "user", "content": f"question {i}: {_words(random.Random(i), 80)}"}],
            "chat_template_kwargs": {"thinking_mode": MODES[i % 3]}}
    resp = await client.post("/v1/chat/completions", json=body)
    return f"chat {resp.status_code}"


async def _completion(client: httpx.AsyncClient, i: int) -> str:
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": SYSTEM_PROMPTS[i % 3] + f" {i}",
                                                      "max_tokens": 8})
    return f"completion {resp.status_code}"


async def _long(client: httpx.AsyncClient, i: int) -> str:
    body = {"model": MODEL, "max_tokens": 120, "stream": True,
            "messages": [{"role": "user", "content": f"{random.random()} {LONG_TEXT}"}]}
    resp = await client.post("/v1/chat/completions", json=body, headers={"x-m3gate-pool": "long"})
    return f"long {resp.status_code}"


async def _flaky(client: httpx.AsyncClient, i: int) -> str:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"try {i}"}]}
    resp = await client.post("/v1/chat/completions", json=body, headers={"x-m3gate-pool": "flaky"})
    await asyncio.sleep(0.1)
    return f"flaky {resp.status_code}"


async def _precise(client: httpx.AsyncClient, i: int) -> str:
    body = {"model": MODEL, "max_tokens": 8, "stream": i % 2 == 0,
            "messages": [{"role": "system", "content": SYSTEM_PROMPTS[i % 3]},
                         {"role": "user", "content": f"precise {i}: {_words(random.Random(-i), 60)}"}]}
    resp = await client.post("/v1/chat/completions", json=body, headers={"x-m3gate-pool": PRECISE_POOL[0]})
    await asyncio.sleep(0.2)  # a few requests a second: the other pools' signals must not starve
    return f"precise {resp.status_code}"


async def _slo(client: httpx.AsyncClient, i: int) -> str:
    """A streamed chat with a TTFT objective no replica can be predicted to meet: routed as slo_expected_miss (the
    prediction-calibration panels' SLO reasons), and served, since its class is not sheddable."""
    body = {"model": MODEL, "max_tokens": 8, "stream": True,
            "messages": [{"role": "user", "content": f"slo {i}: {_words(random.Random(i), 60)}"}]}
    resp = await client.post("/v1/chat/completions", json=body, headers={"x-slo-ttft-ms": "0.001"})
    await asyncio.sleep(0.3)
    return f"slo {resp.status_code}"


async def _invalid(client: httpx.AsyncClient, i: int) -> str:
    if i % 2:
        resp = await client.post("/v1/chat/completions", content=b"{not json",
                                 headers={"content-type": "application/json"})
    else:
        resp = await client.post("/v1/chat/completions", json={"model": "not-served", "messages": []})
    await asyncio.sleep(0.3)
    return f"invalid {resp.status_code}"


async def _leaver(client: httpx.AsyncClient, i: int) -> str:
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "messages": [{"role": "user", "content": "long?"}],
            "chat_template_kwargs": {"thinking_mode": "disabled"}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        async for _ in resp.aiter_raw():
            break  # the client goes away after the first chunk
    await asyncio.sleep(0.2)
    return "left"


AGENT_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                 "parameters": {"type": "object",
                                                                "properties": {"path": {"type": "string"}},
                                                                "required": ["path"]}}}]


async def _agent_turn(client: httpx.AsyncClient, messages: list[dict[str, Any]], headers: dict[str, str],
                      stream: bool, tools: bool) -> dict[str, Any]:
    """One agent turn; the assistant message as the agent appends it (with the answer's tool-call ids)."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "messages": messages, "stream": stream}
    if tools:
        body.update(tools=AGENT_TOOLS, tool_choice="required")
    calls: dict[int, dict[str, Any]] = {}
    if stream:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:]).get("choices") or []:
                    for call in (choice.get("delta") or {}).get("tool_calls") or []:
                        entry = calls.setdefault(call.get("index", 0), {"id": "", "type": "function",
                                                                        "function": {"name": "", "arguments": ""}})
                        entry["id"] = call.get("id") or entry["id"]
                        fn = call.get("function") or {}
                        entry["function"]["name"] += fn.get("name") or ""
                        entry["function"]["arguments"] += fn.get("arguments") or ""
    else:
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        if resp.status_code == 200:
            for k, call in enumerate(resp.json()["choices"][0]["message"].get("tool_calls") or []):
                calls[k] = call
    out: dict[str, Any] = {"role": "assistant", "content": "ok"}
    if calls:
        out["tool_calls"] = [calls[k] for k in sorted(calls)]
    return out


async def _agent(client: httpx.AsyncClient, i: int) -> str:
    """An agent session: a task, a tool call answered after a tool wait, a final answer, the user's next turn after
    a think time. Even sessions name themselves (x-session-id) and end with x-dynamo-session-final; odd ones are
    found by their tool-call ids and history and end by idle."""
    headers = {"x-m3gate-pool": "agent"}
    named = i % 2 == 0
    if named:
        headers["x-session-id"] = f"obs-agent-{i}-{random.random()}"
    stream = (i // 2) % 2 == 0
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPTS[i % 3]},
                                      {"role": "user", "content": f"task {i}: {_words(random.Random(i), 200)}"}]
    answer = await _agent_turn(client, messages, headers, stream, tools=True)
    messages.append(answer)
    await asyncio.sleep(0.15)  # the tool runs
    for call in answer.get("tool_calls") or []:
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": _words(random.Random(-i), 200)})
    messages.append(await _agent_turn(client, messages, headers, stream, tools=False))
    await asyncio.sleep(0.25)  # the user reads and thinks
    messages.append({"role": "user", "content": f"thanks; now {i}"})
    if named:
        headers["x-dynamo-session-final"] = "true"
    await _agent_turn(client, messages, headers, stream, tools=False)
    return f"agent {'header' if named else 'inferred'}"


WORKERS = [_chat] * 4 + [_completion, _long, _long, _long, _flaky, _invalid, _leaver, _precise, _slo, _agent, _agent]


async def drive(url: str, duration_s: float) -> Counter[str]:
    """Run every worker in a loop until `duration_s` has passed; returns outcome counts."""
    outcomes: Counter[str] = Counter()
    deadline = time.monotonic() + duration_s
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async def loop(worker: Any, offset: int) -> None:
            i = offset
            while time.monotonic() < deadline:
                try:
                    outcomes[await worker(client, i)] += 1
                except httpx.HTTPError as exc:
                    outcomes[f"{worker.__name__} {type(exc).__name__}"] += 1
                i += len(WORKERS)

        await asyncio.gather(*(loop(w, n) for n, w in enumerate(WORKERS)))
    return outcomes


def run_load(url: str, duration_s: float) -> Counter[str]:
    return asyncio.run(drive(url, duration_s))


def wait_for_scrapes(prometheus: Prometheus, seconds: float = 2.5) -> None:
    """Let Prometheus take the last samples after the load (1 s scrapes) before reading ranges."""
    time.sleep(seconds)
