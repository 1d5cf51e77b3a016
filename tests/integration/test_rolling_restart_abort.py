"""A rolling restart that aborts the streams in flight loses no request either: three simulated replicas launched
with `--shutdown-timeout 0` (vLLM's default: on SIGTERM it stops listening and ends every stream in flight with
finish_reason "abort", which only stream migration can hide from the client),
8 OpenAI SDK clients streaming 100-token answers through the gateway without pause, and each replica restarted in
turn as Kubernetes does it (SIGTERM, wait for the exit, a new process on the same port, wait until healthy). Every
stream completes whole (resumed on another replica), and once the gateway knows a replica is going no new request
reaches it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims
from tests.support.rolling_restart import MODEL, Load, gateway_config, replica_view, restart, sim_args

pytestmark = pytest.mark.slow
SHUTDOWN_TIMEOUT_S = 0


@pytest.fixture
def replicas() -> Iterator[list[SimProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": sim_args(SHUTDOWN_TIMEOUT_S)}
                       for _ in range(3)]) as sims:
        yield sims


def test_a_rolling_restart_that_aborts_streams_fails_no_request(replicas: list[SimProcess]) -> None:
    gw: GatewayProcess = start_gateway(gateway_config(replicas))
    sims = list(replicas)
    load = Load(gw.base_url, streams=8)
    client = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=30)

    def nudge() -> None:  # one short request: it must succeed wherever the gateway sends it
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)

    try:
        load.start()
        started = time.monotonic()
        time.sleep(2)
        restarts = []
        for i, sim in enumerate(sims):
            sims[i], result = restart(gw, sim, SHUTDOWN_TIMEOUT_S, nudge)
            restarts.append(result)
        load.stop()
        elapsed = time.monotonic() - started
        print(f"\nrolling restart: {load.completed} streams completed in {elapsed:.1f} s, "
              f"{len(load.failures)} failed; per restart: "
              + ", ".join(f"{r.seconds:.1f} s ({r.reason}: {r.reached_before_mark}, after {r.reached_after_mark})"
                          for r in restarts))
        assert load.failures == []
        assert load.completed >= 24, "the load kept streaming through the restarts"
        for r in restarts:
            assert r.reached_after_mark == 0, r  # drained: no new request once it had refused one
            assert r.reached_before_mark == 0, r  # it stopped listening at SIGTERM
        for sim in sims:
            view = replica_view(gw, sim.url)
            assert view["available"], view  # back in rotation (aborted streams may count against it)
        metrics = httpx.get(gw.url + "/metrics", timeout=5).text
        assert "m3gate_stream_migrations_total" in metrics
    finally:
        load.stop()
        gw.stop()
        for sim in sims:
            if sim not in replicas:
                sim.stop()
