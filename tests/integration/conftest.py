"""Fixtures the integration tests share: a Redis server of the test's own, and key prefixes on the machine's."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from loadtests.lib.private_redis import PrivateRedis
from tests.support.shared import SHARED_REDIS
from tests.support.tools import require_tools



@pytest.fixture(scope="module")
def private_redis() -> Iterator[PrivateRedis]:
    """A redis-server of this test module's own on a free port (tests may stop and restart it)."""
    require_tools("redis-server")
    server = PrivateRedis(db=7)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A key prefix on the shared Redis that no other test uses; its keys (and only they) are deleted afterwards."""
    key_prefix = f"m3gate-test:{uuid.uuid4().hex}:"
    yield key_prefix
    client = aioredis.Redis.from_url(SHARED_REDIS)
    try:
        keys = [k async for k in client.scan_iter(match=key_prefix + "*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
