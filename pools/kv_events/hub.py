"""`KvEventHub`: the KV-event subscriptions of a set of replicas, kept in step with the replica set.

Per replica one task: it subscribes a `SourceSubscriber` to each of the replica's sources (sources.py), from config
or, when the config names no endpoint, from `GET /kv_event_sources` (asked again when the discovered sources stay
unreachable: a replica restarted with `tcp://*:0` publishes on new ports). `sync()` after each config reload or
discovery adds and removes replicas; a removed one's task stops and its blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson
import zmq.asyncio

from pools.exact_index import ExactIndex
from pools.kv_events.sources import KvEventSource, ReplicaEvents, sources_from_config, sources_from_discovery
from pools.kv_events.subscriber import Clock, SourceStats, SourceSubscriber, SubscriberSettings

__all__ = ["KvEventHub"]

log = logging.getLogger("m3gate.kv_events")


@dataclass
class _Feed:
    target: ReplicaEvents
    task: asyncio.Task[None] | None = None
    sources: list[KvEventSource] = field(default_factory=list)
    stats: dict[str, SourceStats] = field(default_factory=dict)


class KvEventHub:
    """Subscriptions for every replica of the pools that route precisely; `sync()` them to the current set."""

    def __init__(
        self, index: ExactIndex, clock: Clock | None = None, settings: SubscriberSettings | None = None
    ) -> None:
        self.index = index
        self.clock = clock or index.clock
        self.settings = settings or SubscriberSettings()
        self._feeds: dict[str, _Feed] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._session: aiohttp.ClientSession | None = None
        self._started = False

    async def start(self, session: aiohttp.ClientSession | None = None) -> None:
        """Start the tasks (needs a running loop); `session` serves /kv_event_sources discovery."""
        self._session = session
        self._ctx = zmq.asyncio.Context()
        self._started = True
        for feed in self._feeds.values():
            self._launch(feed)

    async def stop(self) -> None:
        self._started = False
        tasks = [f.task for f in self._feeds.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for feed in self._feeds.values():
            feed.task = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def sync(self, targets: Mapping[str, ReplicaEvents]) -> None:
        """Subscribe to exactly these replicas; a changed target restarts its feed, a removed one is freed."""
        for replica in [r for r in self._feeds if r not in targets]:
            self._drop(replica)
        for replica, target in targets.items():
            feed = self._feeds.get(replica)
            if feed is not None and replace(feed.target, kv_blocks=target.kv_blocks) != target:
                self._drop(replica)
                feed = None
            if feed is None:
                feed = self._feeds[replica] = _Feed(target)
                if self._started:
                    self._launch(feed)
            else:
                feed.target = target
                for source in feed.sources:
                    self.index.add_source(source.key, replica, target.kv_blocks)

    def _drop(self, replica: str) -> None:
        feed = self._feeds.pop(replica)
        if feed.task is not None:
            feed.task.cancel()
        for source in feed.sources:
            self.index.remove_source(source.key)

    def _launch(self, feed: _Feed) -> None:
        feed.task = asyncio.get_running_loop().create_task(
            self._run_feed(feed), name=f"m3gate-kv-events {feed.target.replica}"
        )

    async def _run_feed(self, feed: _Feed) -> None:
        """Subscribe to the replica's sources; discovered ones are looked up again when they stay unreachable (a
        replica restarted with `tcp://*:0` publishes on new ports)."""
        target = feed.target
        while True:
            sources = sources_from_config(target) if target.endpoint else await self._discover(target)
            for old in feed.sources:
                if old not in sources:
                    self.index.remove_source(old.key)
            feed.sources = sources
            for source in sources:
                self.index.add_source(source.key, target.replica, target.kv_blocks)
                feed.stats[source.key] = SourceStats()
            assert self._ctx is not None
            tasks = [asyncio.ensure_future(
                SourceSubscriber(self._ctx, s, self.index, self.clock, self.settings, feed.stats[s.key]).run())
                for s in sources]
            log.info("KV events for %s: %s", target.replica, ", ".join(s.endpoint for s in sources))
            try:
                if target.endpoint:
                    await asyncio.gather(*tasks)
                    return
                while not self._unreachable(feed):
                    await asyncio.sleep(self.settings.rediscover_after_s / 4)
                log.warning("KV events for %s unreachable for %.0fs: asking /kv_event_sources again",
                            target.replica, self.settings.rediscover_after_s)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _unreachable(self, feed: _Feed) -> bool:
        now = self.clock()
        downs = [feed.stats[s.key].down_since for s in feed.sources]
        return bool(downs) and all(d is not None and now - d > self.settings.rediscover_after_s for d in downs)

    async def _discover(self, target: ReplicaEvents) -> list[KvEventSource]:
        """GET /kv_event_sources until it names a zmq publisher (the replica may still be starting)."""
        timeout = aiohttp.ClientTimeout(total=5)
        while True:
            if self._session is not None:
                try:
                    async with self._session.get(
                        target.replica + "/kv_event_sources", headers=dict(target.headers), timeout=timeout
                    ) as resp:
                        if resp.status == 200:
                            sources = sources_from_discovery(target.replica, orjson.loads(await resp.read()))
                            if sources:
                                return sources
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError, orjson.JSONDecodeError):
                    pass
            await asyncio.sleep(self.settings.discovery_retry_s)

    # -- introspection ------------------------------------------------------------------------------------------

    def replicas(self) -> list[str]:
        return list(self._feeds)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per source: endpoint, counters, and the index's view (blocks, freshness)."""
        now = self.clock()
        out: dict[str, dict[str, Any]] = {}
        for replica, feed in self._feeds.items():
            for source in feed.sources:
                s = feed.stats.get(source.key) or SourceStats()
                out[source.key] = {
                    "replica": replica, "pool": feed.target.pool, "endpoint": source.endpoint,
                    "blocks": self.index.size(replica), "stale_reason": self.index.stale_reason(replica, now),
                    **{k: getattr(s, k) for k in SourceStats.__dataclass_fields__},
                }
        return out

    def iter_sources(self) -> Iterator[tuple[str, str, SourceStats, ExactIndex]]:
        """(pool, source key, stats, index) for every source (the metrics collector)."""
        for feed in self._feeds.values():
            for source in feed.sources:
                yield feed.target.pool, source.key, feed.stats.get(source.key) or SourceStats(), self.index
