"""`server.workers: 2`: two gateway processes on one port route as one gateway.

Three simulated replicas, `m3gate serve` with two workers, `state: redis://...` on a Redis of the test's own, and
`server.worker_port_base` so the test can address each worker on its own port as well as both on the shared one.

- both workers answer on the shared port (each one's own /metrics counts requests);
- a session's turns sent alternately through worker 0 and worker 1 all reach the replica the session was pinned to,
  and a request sharing its prefix without the session finds that replica too. Not passable by luck: the session is
  pinned first to a replica that is NOT its prefix's cold (rendezvous) choice, so a worker that did not learn the
  pin and the prefix from the other would send it elsewhere;
- SIGHUP to the supervisor reloads every worker, and a batch file uploaded through one worker is read through the
  other (one batch folder and store for all);
- a worker killed with SIGKILL is replaced, and SIGTERM to the supervisor stops every worker cleanly and removes the
  batch folder it made.
"""

from __future__ import annotations

import os
import random
import re
import signal
import string
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, child_pids, consecutive_free_ports, start_gateway
from loadtests.lib.private_redis import PrivateRedis
from policies.prefix import prefix_blocks
from policies.replica_choice import rendezvous_weight
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"


def _wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url} did not become healthy")


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[SimProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--speed", "50"]} for _ in range(3)]) as sims:
        yield sims


@pytest.fixture(scope="module")
def workers(private_redis: PrivateRedis, replicas: list[SimProcess]) -> Iterator[tuple[GatewayProcess, list[str]]]:
    base = consecutive_free_ports(2)
    config = {
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": [s.url for s in replicas]}],
        "routing": {"policy": "prefix_affinity"},
        "state": f"redis://127.0.0.1:{private_redis.port}/7",
        "server": {"health_interval_s": 0.5, "workers": 2, "worker_port_base": base},
        "admin": {"watch_config": False},  # reloads come from SIGHUP and the admin API only
    }
    gw = start_gateway(config)
    own = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    try:
        for url in own:
            _wait_healthy(url)
        yield gw, own
    finally:
        gw.stop(20)


def _batch_dirs(pids: set[int]) -> set[str]:
    """The batch folders the workers were given (M3GATE_BATCH_FILES_DIR in their environment)."""
    names = set()
    for pid in pids:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"M3GATE_BATCH_FILES_DIR="):
                names.add(Path(item.split(b"=", 1)[1].decode()).name)
    return names


def _requests_answered(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r'^m3gate_requests_total\{[^}]*status="200"[^}]*\} (\S+)$', text, re.M))


def _text(rnd: random.Random, n_chars: int) -> str:
    words = ["".join(rnd.choices(string.ascii_lowercase, k=rnd.randint(2, 9))) for _ in range(300)]
    return " ".join(rnd.choice(words) for _ in range(n_chars // 6))[:n_chars]


def _cold_choice(messages: list[dict[str, Any]], urls: list[str]) -> str:
    first = prefix_blocks({"model": MODEL, "messages": messages}, "chat", MODEL)[0]
    return max(urls, key=lambda url: rendezvous_weight(first, url))


def _turn(url: str, messages: list[dict[str, Any]], session: str | None) -> tuple[str, str]:
    """One chat turn through the OpenAI SDK on its own connection: (the answer, the replica that served it)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    try:
        extra = {"user": session} if session else {}
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                               max_tokens=4, **extra)
        answer = raw.parse().choices[0].message.content or ""
        return answer, raw.headers["x-m3gate-endpoint"]
    finally:
        client.close()


def test_both_workers_answer_on_the_shared_port(workers: tuple[GatewayProcess, list[str]]) -> None:
    gw, own = workers
    before = [_requests_answered(url) for url in own]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(40):  # a new connection each: the kernel spreads connections over the workers
        assert httpx.post(gw.base_url + "/chat/completions", json=body, timeout=30).status_code == 200
    served = [_requests_answered(url) - b for url, b in zip(own, before, strict=True)]
    assert sum(served) == 40 and min(served) > 0, f"requests per worker: {served}"


def test_a_sessions_turns_through_either_worker_reach_one_replica(
    workers: tuple[GatewayProcess, list[str]], replicas: list[SimProcess]
) -> None:
    gw, own = workers
    urls = [s.url for s in replicas]
    rnd = random.Random(f"workers-{time.time_ns()}")
    session = f"workers-session-{rnd.random()}"
    _, pinned = _turn(own[0], [{"role": "user", "content": "hi"}], session)  # too short for a block: by rotation
    while True:  # ~2,500 tokens of system prompt whose cold choice is another replica
        system = _text(rnd, 10_000)
        if _cold_choice([{"role": "system", "content": system}, {"role": "user", "content": "q"}], urls) != pinned:
            break
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(6):
        time.sleep(0.3)  # the pin and the prefix reach the other worker through Redis
        messages.append({"role": "user", "content": f"question {turn}?"})
        answer, endpoint = _turn(own[turn % 2], messages, session)
        assert endpoint == pinned, f"turn {turn} through worker {turn % 2} went to {endpoint}, not {pinned}"
        messages.append({"role": "assistant", "content": answer})
    time.sleep(0.3)
    _, endpoint = _turn(gw.url, [messages[0], {"role": "user", "content": "no session, same prefix"}], None)
    assert endpoint == pinned, "a request sharing the prefix did not find the replica it is cached on"


def test_sighup_reloads_every_worker_and_a_batch_file_is_one_folder_for_all(
    workers: tuple[GatewayProcess, list[str]]
) -> None:
    gw, own = workers
    os.kill(gw.pid, signal.SIGHUP)
    deadline = time.monotonic() + 20
    while not all(httpx.get(url + "/admin/reload", timeout=5).json()["message"].startswith("SIGHUP") for url in own):
        assert time.monotonic() < deadline, f"not every worker reloaded:\n{gw.log_tail()}"
        time.sleep(0.1)
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}\n'
    uploaded = httpx.post(own[0] + "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", line)},
                          timeout=10)
    assert uploaded.status_code == 200, uploaded.text
    seen = httpx.get(own[1] + f"/v1/files/{uploaded.json()['id']}", timeout=10)
    assert seen.status_code == 200 and seen.json()["filename"] == "in.jsonl", seen.text


def test_a_reload_through_the_shared_port_reloads_every_worker(workers: tuple[GatewayProcess, list[str]]) -> None:
    """POST /admin/reload reaches one worker (the connection's); that one validates and applies the file and asks
    the supervisor to forward SIGHUP, so every worker serves the edited config, not just the one asked."""
    gw, own = workers
    config = httpx.get(own[0] + "/admin/config", timeout=5).json()
    slack = config["routing"]["load_slack"] + 1.0
    edited = yaml.safe_load(gw.config_path.read_text())
    edited.setdefault("routing", {})["load_slack"] = slack
    gw.write_config(edited)
    answer = httpx.post(gw.url + "/admin/reload", timeout=10)
    assert answer.status_code == 200 and answer.json()["workers"].startswith("all"), answer.text
    deadline = time.monotonic() + 20
    while not all(httpx.get(url + "/admin/config", timeout=5).json()["routing"]["load_slack"] == slack
                  for url in own):
        assert time.monotonic() < deadline, f"not every worker reloaded:\n{gw.log_tail()}"
        time.sleep(0.1)


def test_a_killed_worker_is_replaced_and_sigterm_stops_them_all(workers: tuple[GatewayProcess, list[str]]) -> None:
    gw, own = workers
    first = child_pids(gw.pid)
    assert len(first) == 2
    victim = min(first)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not (len(child_pids(gw.pid)) == 2 and victim not in child_pids(gw.pid)):
        assert time.monotonic() < deadline, f"no replacement for worker {victim}:\n{gw.log_tail()}"
        time.sleep(0.1)
    for url in own:
        _wait_healthy(url)
    assert "restarting in" in gw.log_path.read_text()
    pids = child_pids(gw.pid)
    batch_dirs = _batch_dirs(pids)
    assert len(batch_dirs) == 1  # one folder for both workers
    gw.stop(20)
    assert gw._proc.returncode == 0, gw.log_tail()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert not [p for p in Path(tempfile.gettempdir()).glob("m3gate-batch-*") if p.name in batch_dirs]
    log = gw.log_path.read_text()
    assert "SIGTERM: stopping 2 workers" in log and "Traceback" not in log, gw.log_tail()
