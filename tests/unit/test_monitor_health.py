"""The replica monitor's health rule: a refused connection or a non-200 /health marks a replica unhealthy at once; a
timed-out probe only when it is the second in a row (a gateway whose event loop lags on a busy machine would
otherwise fail every probe at once and leave its pool with no replica), and an answer in between resets the count."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from gateway.cli.launcher import free_port
from pools.monitor import TIMEOUTS_TO_UNHEALTHY, ReplicaMonitor
from pools.replicas import Replica


class SlowHealth:
    """/health that answers 200 after `delay_s`, or `status` at once."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.status = 200

    async def health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.delay_s)
        return web.Response(status=self.status)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")


async def _serve(fake: SlowHealth) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/health", fake.health)
    app.router.add_get("/metrics", fake.metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def test_timeouts_count_only_in_a_row_and_errors_at_once() -> None:
    assert TIMEOUTS_TO_UNHEALTHY == 2

    async def run() -> None:
        fake = SlowHealth()
        runner, port = await _serve(fake)
        replica = Replica(url=f"http://127.0.0.1:{port}", pool="p")
        try:
            async with aiohttp.ClientSession() as session:
                monitor = ReplicaMonitor(session, lambda: [replica], interval_s=0.1)  # probe timeout: 0.5 s
                await monitor.poll_once()
                assert replica.healthy
                fake.delay_s = 1.0
                await monitor.poll_once()
                assert replica.healthy  # one timeout: not yet
                fake.delay_s = 0.0
                await monitor.poll_once()  # an answer resets the count
                fake.delay_s = 1.0
                await monitor.poll_once()
                assert replica.healthy
                await monitor.poll_once()
                assert not replica.healthy  # the second in a row
                fake.delay_s = 0.0
                await monitor.poll_once()
                assert replica.healthy
                fake.status = 500
                await monitor.poll_once()
                assert not replica.healthy  # an error answer: at once
                fake.status = 200
                await monitor.poll_once()
                assert replica.healthy
        finally:
            await runner.cleanup()
        refused = Replica(url=f"http://127.0.0.1:{free_port()}", pool="p")
        async with aiohttp.ClientSession() as session:
            await ReplicaMonitor(session, lambda: [refused], interval_s=0.1).poll_once()
        assert not refused.healthy  # nothing listens: at once

    asyncio.run(run())


def test_the_scrape_asks_for_just_the_samples_routing_reads_and_the_sim_answers_only_those() -> None:
    """vLLM's /metrics (prometheus_client) filters on sample names given as `name[]`; so does the simulator."""
    from urllib.parse import parse_qs, urlsplit

    from pools.monitor import METRICS_PATH, WANTED_SAMPLES, parse_vllm_metrics
    from pools.sim.metrics import SimMetrics, cache_config_labels

    names = parse_qs(urlsplit(METRICS_PATH).query)["name[]"]
    assert names == list(WANTED_SAMPLES)
    labels = cache_config_labels(block_size=16, num_gpu_blocks=4096, enable_prefix_caching=True, hash_algo="sha256",
                                 max_model_len=8192)
    metrics = SimMetrics("m", 8192, labels)
    metrics.prefix_cache_queries.inc(10)
    metrics.prefix_cache_hits.inc(4)
    full = metrics.render(running=2, waiting=3, kv_usage=0.25)
    asked = metrics.render(running=2, waiting=3, kv_usage=0.25, names=names)
    assert len(asked) * 5 < len(full)
    samples = {line.split("{")[0] for line in asked.decode().splitlines() if line and not line.startswith("#")}
    assert samples == set(WANTED_SAMPLES)
    load = parse_vllm_metrics(asked)
    assert parse_vllm_metrics(full) == load
    assert (load.running, load.waiting, load.kv_usage, load.prefix_queries, load.prefix_hits, load.num_gpu_blocks) \
        == (2, 3, 0.25, 10, 4, 4096)


def test_a_failed_request_brings_a_backed_off_replicas_health_probe_at_once_and_a_dispatch_its_scrape() -> None:
    async def run() -> None:
        fake = SlowHealth()
        runner, port = await _serve(fake)
        replica = Replica(url=f"http://127.0.0.1:{port}", pool="p")
        try:
            async with aiohttp.ClientSession() as session:
                monitor = ReplicaMonitor(session, lambda: [replica], interval_s=0.1)  # longest period: 1.6 s
                await monitor.poll_once()
                monitor.start()
                await asyncio.sleep(3.5)
                state = monitor.state_of(replica)
                assert state is not None and state.period_s == 1.6 and replica.probe_backed_off
                visited = state.visited_at
                replica.guard(10).release()  # a dispatch: back to the interval
                assert not replica.probe_backed_off and state.period_s == 0.1
                await asyncio.sleep(0.3)
                assert state.visited_at > visited
                await asyncio.sleep(3.0)  # idle again: backed off
                assert replica.probe_backed_off
                fake.status = 500
                replica.record_failure(time.monotonic(), answered=True)
                await asyncio.sleep(0.3)
                assert not replica.healthy  # probed at once, not at its next backed-off visit
                await monitor.stop()
                assert replica.probe_wake is None
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_the_metrics_reader_sums_engines_and_reads_only_the_cache_configs_two_labels() -> None:
    from pools.monitor import parse_vllm_metrics

    body = (b'# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
            b'# TYPE vllm:num_requests_running gauge\n'
            b'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            b'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
            b'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0 1712345678000\n'
            b'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0\n'
            b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            b'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n'
            b'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1e3\n'
            b'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0\n'
            b'vllm:cache_config_info{block_size="16",engine="0",hash_block_size="None",label="a}b, c",'
            b'effective_attention_block_size="32",num_gpu_blocks="100"} 1.0\n'
            b'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="50"} 1.0\n')
    load = parse_vllm_metrics(body)
    assert (load.running, load.waiting, load.kv_usage, load.prefix_queries, load.prefix_hits) == (5, 1, 0.375, 1000, 250)
    assert (load.num_gpu_blocks, load.block_size) == (150, 16)
    with pytest.raises(ValueError):
        parse_vllm_metrics(b'vllm:num_requests_running{engine="0"} soon\n')
