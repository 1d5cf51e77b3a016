"""A rolling restart under streaming load loses no request: three simulated replicas, 8 OpenAI SDK clients streaming
100-token answers through the gateway without pause, and each replica restarted in turn as Kubernetes does it
(SIGTERM, wait for the exit, a new process on the same port, wait until healthy). Both of vLLM 0.32's SIGTERM
behaviours (the simulator's `--shutdown-timeout N`):

- N = 30: new requests are refused with a 500 while the streams in flight finish; once the gateway has seen a
  replica refuse a request, no new request reaches it (draining);
- N = 0 (vLLM's default): the replica stops listening and ends every stream in flight with finish_reason "abort";
  only stream migration hides that from the client: each aborted stream is resumed on another replica.

Every stream completes whole in both."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import SimProcess, running_sims
from tests.support.rolling_restart import MODEL, Load, gateway_config, replica_view, restart, sim_args

pytestmark = pytest.mark.slow


@pytest.fixture(params=[30, 0], ids=["shutdown-timeout-30", "shutdown-timeout-0"])
def replicas(request: pytest.FixtureRequest) -> Iterator[tuple[int, list[SimProcess]]]:
    with running_sims([{"max_model_len": 8192, "extra_args": sim_args(request.param)} for _ in range(3)]) as sims:
        yield request.param, sims


def test_a_rolling_restart_fails_no_request(replicas: tuple[int, list[SimProcess]]) -> None:
    shutdown_timeout_s, started_sims = replicas
    gw: GatewayProcess = start_gateway(gateway_config(started_sims))
    sims = list(started_sims)
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
            sims[i], result = restart(gw, sim, shutdown_timeout_s, nudge)
            restarts.append(result)
        deadline = time.monotonic() + 30  # the gateway keeps serving the load once the last replica is back
        while load.completed < 24 and time.monotonic() < deadline:
            time.sleep(0.1)
        load.stop()
        elapsed = time.monotonic() - started
        print(f"\nrolling restart (--shutdown-timeout {shutdown_timeout_s}): {load.completed} streams completed in "
              f"{elapsed:.1f} s, {len(load.failures)} failed; per restart: "
              + ", ".join(f"{r.seconds:.1f} s ({r.reason}: {r.reached_before_mark}, after {r.reached_after_mark})"
                          for r in restarts))
        assert load.failures == []
        assert load.completed >= 24, "the load kept streaming through the restarts"
        for r in restarts:
            assert r.reached_after_mark == 0, r  # drained: no new request once it had refused one
            # only requests racing the first refusal; none where the replica stopped listening at SIGTERM
            assert r.reached_before_mark <= (3 if shutdown_timeout_s else 0), r
        metrics = httpx.get(gw.url + "/metrics", timeout=5).text
        for sim in sims:
            view = replica_view(gw, sim.url)
            assert view["available"], view  # back in rotation
            if shutdown_timeout_s:  # streams finished on their replica: nothing counted against it
                assert view["drains"] >= 1 and view["ejections"] == 0, view
                assert f'm3gate_replica_drains_total{{endpoint="{sim.url}",pool="interactive"}} 1.0' in metrics
        resumed = re.search(r'm3gate_stream_migrations_total\{outcome="resumed",pool="interactive"\} (\S+)', metrics)
        if shutdown_timeout_s == 0:  # every replica had streams in flight when it aborted them
            assert resumed is not None and float(resumed.group(1)) >= 3, metrics
    finally:
        load.stop()
        gw.stop()
        for sim in sims:
            if sim not in started_sims:
                sim.stop()
