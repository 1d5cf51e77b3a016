"""What several test modules share: the machine's Redis URL, waiting for a condition with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

SHARED_REDIS = "redis://127.0.0.1:6379/7"  # the machine's Redis (make test starts one if absent), db 7


async def eventually(check: Callable[[], bool], within: float, step: float = 0.01) -> float:
    """Seconds until `check()` held; fails the test after `within` seconds."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > within:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(step)
    return time.monotonic() - start
