"""`pools.tasks.cancel_and_wait` and the background loops that stop with it (replica monitor, simulator engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from pools.monitor import ReplicaMonitor
from pools.sim.engine import Engine
from pools.sim.metrics import SimMetrics
from pools.sim.settings import CostModel
from pools.tasks import cancel_and_wait


async def test_cancel_and_wait_cancels_and_swallows_the_cancellation() -> None:
    task = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled()


async def test_cancel_and_wait_accepts_a_finished_task() -> None:
    task = asyncio.create_task(asyncio.sleep(0))
    await task
    await cancel_and_wait(task)
    assert task.done() and not task.cancelled()


async def test_cancel_and_wait_lets_other_exceptions_through() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await cancel_and_wait(task)


def _monitor() -> ReplicaMonitor:
    return ReplicaMonitor(None, lambda: [], interval_s=0.01)  # type: ignore[arg-type] # no replicas: no HTTP


def _engine() -> Engine:
    return Engine(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64, cost=CostModel(),
                  metrics=SimMetrics("m", max_model_len=128, cache_labels={"block_size": "16"}))


@pytest.mark.parametrize("make", [_monitor, _engine], ids=["replica_monitor", "sim_engine"])
async def test_background_loop_stops_its_task_and_can_stop_twice(make: Callable[[], Any]) -> None:
    loop = make()
    loop.start()
    task = loop._task
    await asyncio.sleep(0.03)
    await loop.stop()
    assert task is not None and task.cancelled() and loop._task is None
    await loop.stop()
