"""DnsEndpointWatcher against a scripted resolver: replicas appear and disappear while it runs, a failed lookup
keeps the last good set, and the config accepts a `discovery:` section."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

import pytest

from policies.config import ConfigError, parse_config
from policies.config import DnsDiscovery
from pools.discovery import DnsEndpointWatcher


class ScriptedDns:
    """A getaddrinfo-shaped resolver whose answer the test changes while the watcher runs."""

    def __init__(self, *addresses: str) -> None:
        self.addresses: list[str] | None = list(addresses)  # None: the lookup fails (NXDOMAIN, server down)
        self.lookups = 0
        self.asked: list[tuple[str, int, Any]] = []
        self.looked_up = asyncio.Event()

    async def __call__(self, host: str, port: int, *, type: int = 0, **_: Any) -> list[tuple[Any, ...]]:
        self.lookups += 1
        self.asked.append((host, port, type))
        self.looked_up.set()
        if self.addresses is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        infos = []
        for a in self.addresses:
            family = socket.AF_INET6 if ":" in a else socket.AF_INET
            sockaddr = (a, port, 0, 0) if family == socket.AF_INET6 else (a, port)
            infos.append((family, socket.SOCK_STREAM, 6, "", sockaddr))
            infos.append((family, socket.SOCK_DGRAM, 17, "", sockaddr))  # duplicates the OS may return
        return infos

    async def next_lookups(self, n: int = 2) -> None:
        """Wait until n more lookups happened (so at least one full refresh saw the current answer)."""
        target = self.lookups + n
        async with asyncio.timeout(2):
            while self.lookups < target:
                self.looked_up.clear()
                await self.looked_up.wait()


class Changes:
    def __init__(self) -> None:
        self.calls: list[tuple[set[str], set[str]]] = []
        self.current: set[str] = set()

    def __call__(self, added: set[str], removed: set[str]) -> None:
        self.calls.append((added, removed))
        self.current = (self.current | added) - removed


DISCOVERY = DnsDiscovery(dns_name="vllm-short.m3gate.svc.cluster.local", port=8000, refresh_s=0.01)


async def test_replicas_appearing_and_disappearing_are_reported_while_running() -> None:
    dns = ScriptedDns("10.0.0.1", "10.0.0.2")
    changes = Changes()
    async with DnsEndpointWatcher(DISCOVERY, changes, resolver=dns) as watcher:
        await dns.next_lookups()
        assert changes.calls == [({"http://10.0.0.1:8000", "http://10.0.0.2:8000"}, set())]

        dns.addresses = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]  # a replica became ready
        await dns.next_lookups()
        assert changes.calls[-1] == ({"http://10.0.0.3:8000"}, set())

        dns.addresses = ["10.0.0.2", "10.0.0.3"]  # one was drained
        await dns.next_lookups()
        assert changes.calls[-1] == (set(), {"http://10.0.0.1:8000"})
        assert len(changes.calls) == 3  # unchanged answers report nothing
        assert watcher.endpoints == changes.current == {"http://10.0.0.2:8000", "http://10.0.0.3:8000"}
    assert dns.asked[0] == ("vllm-short.m3gate.svc.cluster.local", 8000, socket.SOCK_STREAM)


async def test_failed_lookups_keep_the_last_good_set_and_log_once(caplog: pytest.LogCaptureFixture) -> None:
    dns = ScriptedDns("10.0.0.1", "10.0.0.2")
    changes = Changes()
    caplog.set_level(logging.INFO, logger="pools.discovery")
    async with DnsEndpointWatcher(DISCOVERY, changes, resolver=dns) as watcher:
        await dns.next_lookups()
        dns.addresses = None
        await dns.next_lookups(5)
        assert watcher.failing
        assert watcher.endpoints == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
        assert changes.current == watcher.endpoints and len(changes.calls) == 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "keeping the last 2 endpoints" in warnings[0].getMessage()

        dns.addresses = []  # an empty answer is no reason to drop every replica either
        await dns.next_lookups(3)
        assert watcher.endpoints == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}

        dns.addresses = ["10.0.0.2"]  # DNS back, one replica gone meanwhile
        await dns.next_lookups()
        assert not watcher.failing
        assert changes.calls[-1] == (set(), {"http://10.0.0.1:8000"})
    assert any("recovered" in r.getMessage() for r in caplog.records)


async def test_a_lookup_that_hangs_times_out_and_keeps_the_set() -> None:
    hung = asyncio.Event()

    async def hanging(host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        hung.set()
        await asyncio.sleep(60)
        return []

    watcher = DnsEndpointWatcher(DISCOVERY, Changes(), resolver=hanging, lookup_timeout_s=0.05)
    assert await watcher.refresh() is False
    assert hung.is_set() and watcher.failing and watcher.endpoints == frozenset()


async def test_a_change_the_callback_failed_to_apply_is_offered_again() -> None:
    dns = ScriptedDns("10.0.0.1")
    seen: list[tuple[set[str], set[str]]] = []
    failures = [RuntimeError("pool busy")]

    async def flaky(added: set[str], removed: set[str]) -> None:
        seen.append((added, removed))
        if failures:
            raise failures.pop()

    watcher = DnsEndpointWatcher(DISCOVERY, flaky, resolver=dns)
    assert await watcher.refresh() is True
    assert watcher.endpoints == frozenset()
    assert await watcher.refresh() is True
    assert seen == [({"http://10.0.0.1:8000"}, set())] * 2
    assert watcher.endpoints == {"http://10.0.0.1:8000"}


async def test_ipv6_records_become_bracketed_urls() -> None:
    dns = ScriptedDns("fd00::7", "10.0.0.1")
    changes = Changes()
    discovery = DnsDiscovery(dns_name="vllm-long", port=8443, scheme="https", refresh_s=1)
    assert await DnsEndpointWatcher(discovery, changes, resolver=dns).refresh()
    assert changes.current == {"https://[fd00::7]:8443", "https://10.0.0.1:8443"}


async def test_default_resolver_is_the_event_loops_getaddrinfo() -> None:
    changes = Changes()
    discovery = DnsDiscovery(dns_name="localhost", port=8000, refresh_s=1)
    assert await DnsEndpointWatcher(discovery, changes).refresh()
    assert changes.current and changes.current <= {"http://127.0.0.1:8000", "http://[::1]:8000"}


async def test_stop_ends_the_refresh_task() -> None:
    dns = ScriptedDns("10.0.0.1")
    watcher = DnsEndpointWatcher(DISCOVERY, Changes(), resolver=dns)
    watcher.start()
    await dns.next_lookups()
    await watcher.stop()
    count = dns.lookups
    await asyncio.sleep(0.05)
    assert dns.lookups == count


def _pool_file(discovery: dict[str, Any]) -> str:
    return json.dumps({"model": "m", "pools": [{"name": "short", "max_model_len": 32768, "discovery": discovery}]})


def test_config_accepts_a_discovery_section() -> None:
    cfg = parse_config(_pool_file({"dns_name": "vllm-short.m3gate.svc.cluster.local", "refresh_s": 2}), env={})
    d = cfg.pools[0].discovery
    assert d is not None and (d.port, d.scheme, d.refresh_s) == (8000, "http", 2)


@pytest.mark.parametrize("bad", [
    {"dns_name": "not a name"}, {"dns_name": "x", "refresh_s": 0}, {"dns_name": "x", "scheme": "ftp"},
    {"dns_name": "x", "port": 0}, {"dns_name": "x", "ttl": 5},
])
def test_config_refuses_a_bad_discovery_section(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        parse_config(_pool_file(bad), env={})
