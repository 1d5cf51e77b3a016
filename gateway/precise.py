"""Precise prefix routing as one collaborator of the gateway: a `PrecisePool` (gateway/precise_pool.py) per pool that
routes from its replicas' KV events, kept in step with config reloads and discovery, and the exact block hashes each
request needs.

The coordinator asks two things of it: the prefix matcher a pool's policy reads (`matcher`), and the request with
its exact vLLM block hashes per candidate pool (`routings`). Everything else here is bookkeeping: subscriptions
follow the replica set, a pool whose precise settings change gets a fresh index, and the metrics collector sees
whatever pools exist now.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import replace
from typing import Any

import aiohttp

from gateway.precise_pool import PrecisePool
from policies.config import GatewayConfig
from policies.pool_choice import PoolChoice
from policies.replica_choice import RoutingRequest
from pools.exact_index import ExactIndex, HybridMatcher
from pools.kv_events.collector import PreciseCollector
from pools.kv_events.subscriber import SourceStats
from pools.prefix_index import PrefixIndex
from pools.replicas import PoolRuntime
from pools.tokenizer import HashSettings


class PreciseRouting:
    """The pools with `precise` on (prefix_affinity only), by name, and their background subscriptions."""

    def __init__(self, approx: PrefixIndex, clock: Callable[[], float]) -> None:
        self.approx = approx  # the approximate index, the matcher of every other pool
        self.clock = clock
        self.pools: dict[str, PrecisePool] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # starts and stops after reloads, kept referenced

    def __bool__(self) -> bool:
        return bool(self.pools)

    def configure(self, config: GatewayConfig, pools: Mapping[str, PoolRuntime]) -> set[str]:
        """Keep one PrecisePool per pool that asks for it; returns the pools whose matcher changed (their policies
        are rebuilt). A pool whose precise settings changed gets a fresh one."""
        wanted = {
            p.name: p for p in config.pools
            if p.precise is not None and p.precise.enabled and config.routing.policy == "prefix_affinity"
        }
        changed: set[str] = set()
        for name in [n for n in self.pools if n not in wanted]:
            self._background(self.pools.pop(name).stop())
            changed.add(name)
        for name, pool_cfg in wanted.items():
            current = self.pools.get(name)
            if current is not None and current.identity == PrecisePool.identity_for(pool_cfg, config.model):
                continue
            if current is not None:
                self._background(current.stop())
            fresh = PrecisePool(pool_cfg, config.model, self.approx, self.clock)
            self.pools[name] = fresh
            changed.add(name)
            if self._session is not None:  # running: a reload turned it on
                self._background(fresh.start(self._session, _probe_headers(pools.get(name))))
        return changed

    def matcher(self, pool: str) -> PrefixIndex | HybridMatcher:
        """What the pool's replica policy matches prefixes against: the exact index, else the approximate one."""
        precise = self.pools.get(pool)
        return precise.matcher if precise is not None else self.approx

    def sync(self, pools: Mapping[str, PoolRuntime]) -> None:
        """Subscribe to the KV events of exactly the precise pools' current replicas (config, discovery, reload)."""
        for name, precise in self.pools.items():
            pool = pools.get(name)
            replicas = list(pool.replicas.values()) if pool is not None else []
            precise.hub.sync(precise.targets(replicas, _probe_headers(pool)))

    async def start(self, session: aiohttp.ClientSession, pools: Mapping[str, PoolRuntime]) -> None:
        self._session = session
        for name, precise in self.pools.items():
            await precise.start(session, _probe_headers(pools.get(name)))

    async def stop(self) -> None:
        for precise in self.pools.values():
            await precise.stop()

    def collector(self) -> PreciseCollector:
        """The Prometheus collector of the precise pools (pools come and go with reloads: read them at scrape)."""
        return PreciseCollector(
            _PreciseHubs(self), lambda: {n: p.matcher for n, p in self.pools.items()},
            lambda: {n: p.hasher for n, p in self.pools.items() if p.hasher is not None},
        )

    async def routings(
        self, choice: PoolChoice, routing: RoutingRequest, payload: bytes, api: str,
        pools: Mapping[str, PoolRuntime],
    ) -> dict[str, RoutingRequest]:
        """The request with its exact vLLM block hashes, for each candidate pool that routes precisely (pools that
        hash alike share one computation). Tokenizing runs in a worker thread; a failure means approximate routing."""
        out: dict[str, RoutingRequest] = {}
        done: dict[tuple[HashSettings, str, str | None], tuple[int, ...]] = {}
        now = self.clock()
        for pool_cfg in choice.candidates:
            precise = self.pools.get(pool_cfg.name)
            pool = pools.get(pool_cfg.name)
            if precise is None or pool is None or precise.hasher is None:
                continue
            key = (precise.hash_settings, precise.config.tokenizer, precise.config.model_dir)
            if key not in done:
                replica = next((r.url for r in pool.replicas.values() if r.is_available(now)), None)
                done[key] = await precise.exact_hashes(payload, api, replica)
            if done[key]:
                out[pool_cfg.name] = replace(routing, exact_block_hashes=done[key])
        return out

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(work)
        except RuntimeError:  # no running loop (built before start): nothing was started, nothing to stop
            work.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _probe_headers(pool: PoolRuntime | None) -> dict[str, str]:
    return pool.probe_headers() if pool is not None else {}


class _PreciseHubs:
    """The precise pools' event hubs as one, for the metrics collector."""

    def __init__(self, routing: PreciseRouting) -> None:
        self._routing = routing

    def clock(self) -> float:
        return float(self._routing.clock())

    def iter_sources(self) -> Iterator[tuple[str, str, SourceStats, ExactIndex]]:
        for precise in list(self._routing.pools.values()):
            yield from precise.hub.iter_sources()
