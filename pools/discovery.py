"""Pool endpoints from DNS: in Kubernetes, a pool's headless Service resolves to its ready replicas' pod IPs.

A watcher re-resolves the name on an interval and reports what appeared and what went away. DNS hiccups are
common during rollouts and CoreDNS restarts, so a failed (or empty) lookup never empties a pool: the last good
set is kept, a replica that truly died is caught by the gateway's health checks instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Self

from policies.config import DnsDiscovery

# loop.getaddrinfo's shape: (host, port, *, family=0, type=0, proto=0, flags=0) -> [(family, type, proto, canonname,
# sockaddr)], so the default is the event loop's own (a worker thread) and a test can pass a stub.
Resolver = Callable[..., Awaitable[Sequence[tuple[Any, ...]]]]
OnChange = Callable[[set[str], set[str]], Awaitable[None] | None]

_log = logging.getLogger(__name__)


class DnsEndpointWatcher:
    """Resolves `discovery.dns_name` every `refresh_s` and calls `on_change(added, removed)` with endpoint URLs.

    The set is only replaced once `on_change` returned without raising, so a change the gateway failed to apply
    is offered again on the next refresh.
    """

    def __init__(
        self,
        discovery: DnsDiscovery,
        on_change: OnChange,
        resolver: Resolver | None = None,
        *,
        lookup_timeout_s: float = 5.0,
        logger: logging.Logger | None = None,
    ) -> None:
        self._discovery = discovery
        self._on_change = on_change
        self._resolver = resolver
        self._lookup_timeout_s = lookup_timeout_s
        self._log = logger or _log
        self._endpoints: frozenset[str] = frozenset()
        self._failing = False
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoints(self) -> frozenset[str]:
        """The last good set of endpoint URLs."""
        return self._endpoints

    @property
    def failing(self) -> bool:
        """Whether the latest lookup failed (the last good set is still in use)."""
        return self._failing

    async def refresh(self) -> bool:
        """One lookup; returns True when it succeeded (whether or not anything changed)."""
        async with self._lock:
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that races the lookup, and
                # then stop() would wait forever.
                async with asyncio.timeout(self._lookup_timeout_s):
                    current = await self._lookup()
            except (OSError, ValueError) as exc:  # TimeoutError and socket.gaierror are OSErrors
                self._note_failure(f"{type(exc).__name__}: {exc}")
                return False
            if not current:
                self._note_failure("no A/AAAA records")
                return False
            if self._failing:
                self._log.info("DNS lookup of %s recovered: %d endpoints", self._discovery.dns_name, len(current))
                self._failing = False
            added, removed = set(current - self._endpoints), set(self._endpoints - current)
            if added or removed:
                try:
                    result = self._on_change(added, removed)
                    if inspect.isawaitable(result):
                        await result
                except Exception:  # noqa: BLE001 - the callback's bug must not stop discovery
                    self._log.exception("on_change failed for %s; will offer the change again", self._discovery.dns_name)
                    return True
                self._endpoints = current
            return True

    def start(self) -> None:
        """Refresh now and then every refresh_s, in a task of the running loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"dns-watch {self._discovery.dns_name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._discovery.refresh_s)

    async def _lookup(self) -> frozenset[str]:
        resolver = self._resolver or asyncio.get_running_loop().getaddrinfo
        infos = await resolver(self._discovery.dns_name, self._discovery.port, type=socket.SOCK_STREAM)
        addresses = {info[4][0] for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)}
        return frozenset(self._discovery.url(a) for a in addresses)

    def _note_failure(self, why: str) -> None:
        # Log once per streak of failures: a DNS outage must not flood the log every refresh.
        if not self._failing:
            self._log.warning(
                "DNS lookup of %s failed (%s); keeping the last %d endpoints",
                self._discovery.dns_name, why, len(self._endpoints),
            )
        self._failing = True
