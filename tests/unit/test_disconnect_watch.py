"""DisconnectWatches: a request's disconnect watcher starts only once it has waited `delay`, from one ticker; a
request answered sooner never gets a task; a client gone while the replica works cancels the handler."""

from __future__ import annotations

import asyncio

import pytest

from gateway.relay import DisconnectWatches

pytestmark = pytest.mark.asyncio


def _receive_forever(disconnect: asyncio.Event):  # an ASGI receive that says "disconnect" once the event is set
    async def receive() -> dict:
        await disconnect.wait()
        return {"type": "http.disconnect"}
    return receive


async def test_a_request_answered_before_the_delay_never_starts_a_task() -> None:
    watches = DisconnectWatches(delay=0.05)
    watches.start()
    try:
        before = len(asyncio.all_tasks())
        watch = watches.watch(_receive_forever(asyncio.Event()))
        watch.stop()
        await asyncio.sleep(0.12)
        assert watch._task is None
        assert len(asyncio.all_tasks()) == before
    finally:
        await watches.stop()


async def test_a_client_gone_while_the_replica_works_cancels_the_handler() -> None:
    watches = DisconnectWatches(delay=0.05)
    watches.start()
    gone = asyncio.Event()

    async def handler() -> str:
        watch = watches.watch(_receive_forever(gone))
        try:
            await asyncio.sleep(5)  # the replica, slow
            return "answered"
        except asyncio.CancelledError:
            assert watch.disconnected
            return "cancelled by the watch"
        finally:
            watch.stop()

    try:
        task = asyncio.create_task(handler())
        await asyncio.sleep(0.1)  # past the delay: the watcher runs now
        gone.set()
        assert await asyncio.wait_for(task, 2) == "cancelled by the watch"
    finally:
        await watches.stop()


async def test_without_a_ticker_the_watch_starts_at_once() -> None:
    watches = DisconnectWatches(delay=10)  # never started (an app used without its lifespan)
    watch = watches.watch(_receive_forever(asyncio.Event()))
    try:
        assert watch._task is not None
    finally:
        watch.stop()
