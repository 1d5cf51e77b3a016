"""`pools.tasks`: cancel_and_wait, the Periodic ticker, and the background loops that stop with them (replica monitor,
simulator engine)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest

from pools.monitor import ReplicaMonitor
from pools.sim.engine import Engine
from pools.sim.metrics import SimMetrics
from pools.sim.settings import CostModel
from pools.tasks import Periodic, cancel_and_wait


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


def _task_of(loop: Any) -> asyncio.Task[None] | None:
    return loop._ticker._task if hasattr(loop, "_ticker") else loop._task


@pytest.mark.parametrize("make", [_monitor, _engine], ids=["replica_monitor", "sim_engine"])
async def test_background_loop_stops_its_task_and_can_stop_twice(make: Callable[[], Any]) -> None:
    loop = make()
    loop.start()
    task = _task_of(loop)
    await asyncio.sleep(0.03)
    await loop.stop()
    assert task is not None and task.cancelled() and _task_of(loop) is None
    await loop.stop()


async def _until(condition: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_periodic_survives_a_failing_tick_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def tick() -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise ValueError("a bad reading")

    ticker = Periodic("test-ticker", tick, 0.001)
    with caplog.at_level(logging.ERROR, logger="m3gate.tasks"):
        ticker.start()
        await _until(lambda: len(calls) >= 4)
        await ticker.stop()
    assert not ticker.running
    assert [r.message for r in caplog.records] == ["test-ticker: a tick failed"]
    assert "a bad reading" in caplog.text
    stopped_at = len(calls)
    await asyncio.sleep(0.02)
    assert len(calls) == stopped_at  # stopped means no more ticks
    await ticker.stop()  # twice is fine


async def test_periodic_ticks_first_when_asked_and_reads_the_interval_before_each_wait() -> None:
    waits: list[float] = []
    ticks: list[float] = []

    def every() -> float:
        waits.append(len(ticks))
        return 0.001

    async def tick() -> None:
        ticks.append(len(waits))

    ticker = Periodic("test-first", tick, every, first_at_start=True)
    ticker.start()
    await _until(lambda: len(ticks) >= 3)
    await ticker.stop()
    assert ticks[0] == 0  # the first tick came before any wait
    assert waits[:2] == [1, 2]  # the interval is asked for again before every wait


async def test_periodic_ends_when_its_condition_fails_and_starts_again() -> None:
    live = [True]
    ticks: list[int] = []
    ticker = Periodic("test-while", lambda: ticks.append(1), 0.001, while_=lambda: live[0])
    ticker.start()
    await _until(lambda: len(ticks) >= 2)
    live[0] = False
    await _until(lambda: not ticker.running)
    stopped_at = len(ticks)
    live[0] = True
    ticker.start()
    await _until(lambda: len(ticks) > stopped_at)
    await ticker.stop()
