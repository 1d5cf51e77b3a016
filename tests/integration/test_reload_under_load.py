"""Hot reload while a steady load runs through the gateway: adding an endpoint and removing one take effect within a
second; a malformed YAML file and a well-formed one with an invalid value are both rejected with a message that
says what is wrong (GET /admin/reload) while the previous config keeps serving; and not one request fails."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims

MODEL = "MiniMaxAI/MiniMax-M3"
EFFECTIVE_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": ["--speed", "10"]} for _ in range(3)]) as s:
        yield s


def _config(endpoints: list[str]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "pools": [{"name": "interactive", "max_model_len": 8192, "endpoints": endpoints}],
        "server": {"health_interval_s": 0.3},
        "classification": {"output_budget": {"adaptive": 256, "enabled": 256, "disabled": 256}},
    }


class SteadyLoad:
    """A few clients sending streamed and plain requests back to back, counting every outcome."""

    def __init__(self, gw: GatewayProcess, clients: int = 3) -> None:
        self.gw = gw
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.gw.base_url, timeout=30) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                stream = (n + i) % 2 == 0
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"client {i} request {n}"}],
                        "max_tokens": 12, "stream": stream}
                try:
                    resp = client.post("/chat/completions", json=body)
                    complete = not stream or resp.text.endswith("data: [DONE]\n\n")
                    if resp.status_code == 200 and complete and b'"error"' not in resp.content:
                        self.outcomes[resp.headers["x-m3gate-endpoint"]] += 1
                    else:
                        self.failures.append(f"{resp.status_code}: {resp.text[-300:]}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.01)

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())


def _admin(gw: GatewayProcess, path: str) -> dict[str, Any]:
    resp = httpx.get(gw.url + path, timeout=5)
    resp.raise_for_status()
    return resp.json()


def _endpoints(gw: GatewayProcess) -> set[str]:
    return set(_admin(gw, "/admin/pools")["pools"]["interactive"]["replicas"])


def _within(seconds: float, condition: Callable[[], bool]) -> float:
    """Seconds until `condition` held (polling), or fail after `seconds`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > seconds:
            raise AssertionError(f"not effective within {seconds} s")
        time.sleep(0.02)
    return time.monotonic() - started


def _rejected_after(gw: GatewayProcess, failures_before: int) -> dict[str, Any]:
    _within(EFFECTIVE_WITHIN_S, lambda: _admin(gw, "/admin/reload")["failures"] > failures_before)
    return _admin(gw, "/admin/reload")


def test_reloads_under_steady_load_fail_no_request(sims: list[SimProcess]) -> None:
    a, b, c = (s.url for s in sims)
    gw = start_gateway(_config([a, b]))
    try:
        with SteadyLoad(gw) as load:
            time.sleep(0.5)
            served_before = load.total

            gw.write_config(_config([a, b, c]))  # 1. add an endpoint
            added_in = _within(EFFECTIVE_WITHIN_S, lambda: _endpoints(gw) == {a, b, c})
            _within(3.0, lambda: load.outcomes[c] > 0)  # and it takes traffic

            gw.write_config(_config([b, c]))  # 2. remove one (its requests in flight finish)
            removed_in = _within(EFFECTIVE_WITHIN_S, lambda: _endpoints(gw) == {b, c})
            time.sleep(0.3)
            on_a = load.outcomes[a]
            time.sleep(0.5)
            assert load.outcomes[a] == on_a  # nothing new goes to the removed endpoint

            failures = _admin(gw, "/admin/reload")["failures"]
            malformed = gw.config_path.with_suffix(".tmp")  # 3. malformed YAML, replaced atomically as an editor would
            malformed.write_text("model: MiniMaxAI/MiniMax-M3\npools: [{name: interactive\n")
            os.replace(malformed, gw.config_path)
            status = _rejected_after(gw, failures)
            assert not status["ok"] and "rejected, still serving the previous config" in status["message"]
            assert any("not valid YAML" in p and "line" in p for p in status["problems"]), status
            assert _endpoints(gw) == {b, c}

            bad_value = _config([b, c])
            bad_value["pools"][0]["max_model_len"] = -8192  # 4. valid YAML, invalid value
            gw.write_config(bad_value)
            status = _rejected_after(gw, failures + 1)
            assert not status["ok"]
            assert any("pools.0.max_model_len" in p and "greater than 0" in p and p.startswith("line ")
                       for p in status["problems"]), status
            assert _endpoints(gw) == {b, c}

            gw.write_config(_config([a, b, c]))  # and a good one after the bad ones is applied again
            _within(EFFECTIVE_WITHIN_S, lambda: _admin(gw, "/admin/reload")["ok"] and _endpoints(gw) == {a, b, c})
            time.sleep(0.3)
        assert load.failures == [], load.failures[:5]
        assert load.total - served_before >= 50, load.outcomes  # the load really ran through all of it
        print(f"\nreload under load: {load.total} requests, 0 failed; endpoint added in {added_in * 1000:.0f} ms, "
              f"removed in {removed_in * 1000:.0f} ms")
    finally:
        gw.stop()
