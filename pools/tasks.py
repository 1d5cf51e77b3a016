"""Small asyncio helpers shared by the gateway's background loops and the simulator (which may import from pools)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("m3gate.tasks")


async def cancel_and_wait(task: asyncio.Task[None]) -> None:
    """Cancel a background task and wait until it has finished, swallowing the CancelledError it ends with.

    Any other exception the task raised on its way out propagates to the caller."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


class Periodic:
    """`tick` every `every` seconds in one task named `name`, from start() to stop() (the app's lifespan): a tick's
    exception is logged and the next tick comes as usual, so one bad reading never ends a background duty; stop()
    cancels the task and waits for it. Here, not in gateway/, because the replica monitor (pools/) ticks too.

    `every` may be a function, read before each wait (a reloaded interval applies from the next one); `first_at_start`
    ticks once before the first wait; `while_`, checked before each wait, ends the task when it turns false (a later
    start() runs it again). `tick` may be a plain or an async function."""

    def __init__(self, name: str, tick: Callable[[], Awaitable[None] | None], every: float | Callable[[], float], *,
                 first_at_start: bool = False, while_: Callable[[], bool] | None = None,
                 logger: logging.Logger | None = None) -> None:
        self.name = name
        self._tick = tick
        self._every = every if callable(every) else (lambda: every)
        self._first = first_at_start
        self._while = while_ or (lambda: True)
        self._log = logger or log
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)

    async def _run(self) -> None:
        try:
            if self._first:
                await self._once()
            while self._while():
                await asyncio.sleep(self._every())
                await self._once()
        finally:
            if self._task is asyncio.current_task():
                self._task = None

    async def _once(self) -> None:
        try:
            result = self._tick()
            if inspect.isawaitable(result):
                await result
        except Exception:  # noqa: BLE001 - a failed tick must not end the duty; the next one may succeed
            self._log.exception("%s: a tick failed", self.name)
