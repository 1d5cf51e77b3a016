"""Small asyncio helpers shared by the gateway's background loops and the simulator (which may import from pools)."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task[None]) -> None:
    """Cancel a background task and wait until it has finished, swallowing the CancelledError it ends with.

    Any other exception the task raised on its way out propagates to the caller."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
