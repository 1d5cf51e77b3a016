"""Active health checks and /metrics scraping for every replica, on one short interval.

A replica is healthy when `/health` answers 200; a 503 there (vLLM's engine dead or going) also drains it. A probe
that times out is ambiguous (the replica may hang, or this gateway's own event loop may lag on a busy machine, which
would fail every probe at once and leave the pool with no replica): a healthy replica is marked unhealthy after
`TIMEOUTS_TO_UNHEALTHY` timed-out probes in a row; an answer other than 200 or a refused connection marks it at once.
A replica
draining because it is shutting down (pools/replicas.py `shutting_down`) leaves that state only when a probe shows it
takes requests again: vLLM keeps answering /health 200 all through its shutdown, so health alone cannot tell.

A replica's load (waiting, running, KV usage, prefix counters, cache config) comes from vLLM's own `/metrics`, parsed
with prometheus_client's parser. Only the few families routing reads are fed to the parser, so scraping a replica
costs well under a millisecond of gateway CPU.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from policies.vllm_wire import health_says_draining
from pools.replica_tokenize import post_tokenize
from pools.replicas import Replica, ScrapedLoad
from pools.tasks import Periodic

log = logging.getLogger("m3gate.monitor")

# A request that exercises what a shutting-down vLLM refuses (its renderer) and nothing of its engine.
_PROBE = b'{"prompt":"m3gate drain probe"}'
TIMEOUTS_TO_UNHEALTHY = 2  # timed-out /health probes in a row before a healthy replica counts as unhealthy

_WANTED = (
    b"vllm:num_requests_waiting{",
    b"vllm:num_requests_running{",
    b"vllm:kv_cache_usage_perc{",
    b"vllm:prefix_cache_queries_total{",
    b"vllm:prefix_cache_hits_total{",
    b"vllm:cache_config_info{",
)


def parse_vllm_metrics(text: bytes) -> ScrapedLoad:
    """Sum the routing-relevant series over engines (DP ranks) from a vLLM /metrics body."""
    lines = [line for line in text.split(b"\n") if line.startswith(_WANTED)]
    values: dict[str, float] = {}
    blocks: int | None = None
    block_size: int | None = None
    for family in text_string_to_metric_families(b"\n".join(lines).decode("utf-8", "replace") + "\n"):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                nb = sample.labels.get("num_gpu_blocks")
                bs = sample.labels.get("block_size")
                if nb and nb.isdigit():
                    blocks = (blocks or 0) + int(nb)
                if bs and bs.isdigit():
                    block_size = int(bs)
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    engines = max(1, sum(1 for line in lines if line.startswith(b"vllm:kv_cache_usage_perc{")))
    return ScrapedLoad(
        waiting=values.get("vllm:num_requests_waiting", 0.0),
        running=values.get("vllm:num_requests_running", 0.0),
        kv_usage=values.get("vllm:kv_cache_usage_perc", 0.0) / engines,
        prefix_queries=values.get("vllm:prefix_cache_queries_total", 0.0),
        prefix_hits=values.get("vllm:prefix_cache_hits_total", 0.0),
        num_gpu_blocks=blocks,
        block_size=block_size,
    )


class ReplicaMonitor:
    """Polls every replica returned by `replicas()` each `interval_s`; one task, bounded timeouts."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        replicas: Callable[[], Iterable[Replica]],
        interval_s: float,
        headers_for: Callable[[Replica], dict[str, str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_capacity: Callable[[], None] | None = None,
    ) -> None:
        self._on_capacity = on_capacity
        self._session = session
        self._replicas = replicas
        self._interval_s = interval_s
        self._headers_for = headers_for or (lambda _r: {})
        self._clock = clock
        self._ticker = Periodic("m3gate-replica-monitor", self.poll_once, interval_s, first_at_start=True, logger=log)
        self._timeout = aiohttp.ClientTimeout(total=max(0.5, min(2.0, interval_s)))
        self._timeouts: dict[str, int] = {}  # url → /health probes timed out in a row

    def start(self) -> None:
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()

    async def poll_once(self) -> None:
        replicas = list(self._replicas())
        if replicas:
            await asyncio.gather(*(self._poll(r) for r in replicas), return_exceptions=True)

    async def _takes_requests(self, replica: Replica, headers: dict[str, str]) -> bool:
        """Whether a replica that was shutting down takes requests again (a new process at its URL): a /tokenize,
        which vLLM refuses as it refuses a generate request while it shuts down, answered with anything but that
        refusal or a 5xx. Then it is back in rotation."""
        answer = await post_tokenize(self._session, replica.url, _PROBE, headers, self._timeout.total or 2.0)
        if not answer.status:
            if not answer.refused:
                log.debug("drain probe of %s failed: %r", replica.url, answer.error)
            return False
        if answer.shutting_down or answer.status >= 500:
            return False
        replica.stop_draining()
        return True

    async def _health(self, replica: Replica, headers: dict[str, str]) -> bool | None:
        """Whether /health says the replica serves; None for a timeout that does not yet count (see the module)."""
        url = replica.url
        try:
            async with self._session.get(url + "/health", headers=headers, timeout=self._timeout) as resp:
                await resp.read()
                if health_says_draining(resp.status):
                    replica.start_draining("/health answered 503")
                self._timeouts.pop(url, None)
                return resp.status == 200
        except asyncio.TimeoutError:
            timeouts = self._timeouts[url] = self._timeouts.get(url, 0) + 1
            if len(self._timeouts) > 65_536:  # replicas come and go with discovery
                self._timeouts.pop(next(iter(self._timeouts)))
            return None if replica.healthy and timeouts < TIMEOUTS_TO_UNHEALTHY else False
        except (aiohttp.ClientError, OSError):
            self._timeouts.pop(url, None)
            return False

    async def _poll(self, replica: Replica) -> None:
        headers = self._headers_for(replica)
        healthy = await self._health(replica, headers)
        if healthy is None:
            return  # one timed-out probe: keep the replica as it is, scrape it next time
        if healthy != replica.healthy:
            log.warning("replica %s (pool %s) is now %s", replica.url, replica.pool, "healthy" if healthy else "UNHEALTHY")
        replica.healthy = healthy
        if not healthy:
            return
        if replica.shutting_down is not None and not await self._takes_requests(replica, headers):
            return
        try:
            async with self._session.get(replica.url + "/metrics", headers=headers, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return
                body = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        try:
            load = parse_vllm_metrics(body)
        except ValueError:
            return
        replica.scraped = load
        replica.scraped_at = self._clock()
        if load.num_gpu_blocks and replica.kv_blocks is None:
            replica.kv_blocks = load.num_gpu_blocks  # learnt once; the prefix index is re-bounded to it
            if self._on_capacity is not None:
                self._on_capacity()
