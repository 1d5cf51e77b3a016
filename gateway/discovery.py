"""DNS endpoint discovery for pools that name a headless Service instead of listing endpoints.

One `DnsEndpointWatcher` per pool with a `discovery:` section; its changes add replicas (new ones start healthy and
are probed on the next health tick) or drain removed ones (requests already on them finish). Re-synced after each
config reload, so adding, changing or removing a pool's discovery takes effect without a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from policies.config import DnsDiscovery
from pools.discovery import DnsEndpointWatcher
from pools.replicas import PoolRuntime

log = logging.getLogger("m3gate.discovery")


class DiscoveryManager:
    """Watchers for the pools that have `discovery`; `pools()` is read at each sync (reloads replace the pools),
    `on_change()` runs after a pool's replica set changed."""

    def __init__(
        self, pools: Callable[[], Mapping[str, PoolRuntime]], on_change: Callable[[], None], resolver: Any = None
    ) -> None:
        self._pools = pools
        self._on_change = on_change
        self._resolver = resolver
        self._watchers: dict[tuple[str, str], tuple[DnsDiscovery, DnsEndpointWatcher]] = {}

    async def sync(self) -> None:
        """Start, restart or stop watchers so they match the pools' current `discovery` settings (one per role in a
        disaggregated pool)."""
        wanted = {(name, role): spec for name, pool in self._pools().items()
                  for role, spec in pool.discovery_specs().items()}
        for name, (spec, watcher) in list(self._watchers.items()):
            if wanted.get(name) != spec:
                await watcher.stop()
                del self._watchers[name]
        for name, spec in wanted.items():
            if name in self._watchers:
                continue
            watcher = DnsEndpointWatcher(spec, self._changed(*name), self._resolver)
            self._watchers[name] = (spec, watcher)
            await watcher.refresh()  # the first answer before serving, so a fresh gateway has replicas at once
            watcher.start()

    def _changed(self, pool_name: str, role: str) -> Any:
        def on_change(added: set[str], removed: set[str]) -> None:
            pool = self._pools().get(pool_name)
            if pool is None:
                return
            pool.apply_discovery(added, removed, role)
            self._on_change()
            log.warning("pool %s%s: discovery added %s, removed %s", pool_name,
                        "" if role == "both" else f" ({role})", sorted(added), sorted(removed))

        return on_change

    async def stop(self) -> None:
        for _, watcher in self._watchers.values():
            await watcher.stop()
        self._watchers.clear()
