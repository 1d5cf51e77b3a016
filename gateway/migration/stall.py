"""`StallWatch`: one ticker for all live resumable streams (the package's docstring says where it fits)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.relay import Held, SseFilter
from pools.replicas import Replica
from pools.tasks import Periodic

TICK_S = 0.25
EJECTED_SILENCE_S = 1.0  # a stream this silent on an ejected or unhealthy replica is given up on


class StallWatch:
    """One ticker over every live resumable stream: closes a stream that has been silent longer than its stall
    timeout, or for EJECTED_SILENCE_S while its replica is ejected or has failed more than one health probe in a
    row (one failed probe — a busy replica's slow /health — is no sign of a dead one). A draining vLLM past its
    --shutdown-timeout leaves the connection open and sends nothing; this is how that is noticed. Time the relay
    spends waiting on a slow client (`SseFilter.waiting`) is no silence: the replica is not read then. The ticker
    runs from `start` to `stop` (the app's lifespan): a task and a timer per stream cost more than a tick every
    0.25 s. Used without them (an app without its lifespan), it runs while any stream is live."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, probe_interval_s: float = 0.0) -> None:
        self.clock = clock
        self.probe_interval_s = probe_interval_s
        self._live: dict[int, list[Any]] = {}
        self._started = False
        self._ticker = Periodic("m3gate-stall-watch", self._tick, TICK_S,
                                while_=lambda: bool(self._live) or self._started)

    def add(self, filt: SseFilter, held: Held, replica: Replica, timeout: float) -> int:
        key = id(held)
        # filter, held, replica, timeout, events seen, since when, since when its replica looks down (0: it does not)
        self._live[key] = [filt, held, replica, timeout, filt.events, self.clock(), 0.0]
        self._ticker.start()
        return key

    def remove(self, key: int) -> None:
        self._live.pop(key, None)

    def start(self) -> None:
        self._started = True
        self._ticker.start()

    async def stop(self) -> None:
        self._started = False
        await self._ticker.stop()

    def _tick(self) -> None:
        now = self.clock()
        for key, entry in list(self._live.items()):
            if entry[1].response is None:  # the stream ended (its Held was released)
                del self._live[key]
            else:
                self.check(entry, now)

    def check(self, entry: list[Any], now: float) -> None:
        """One stream at one tick: progress (or a wait on the client) restarts its clock; else it may be cut."""
        filt, held, replica, timeout, seen, since, _ = entry
        if filt.events != seen or filt.waiting:
            entry[4], entry[5] = filt.events, now
            return
        down = now < replica.ejected_until or not replica.healthy
        entry[6] = (entry[6] or now) if down else 0.0
        silent = now - since
        dead = now < replica.ejected_until or (down and now - entry[6] > self.probe_interval_s)
        if silent > timeout or (silent > EJECTED_SILENCE_S and dead):
            filt.failure = filt.failure or "stall"
            if held.response is not None:
                held.response.close()  # the relay's read ends: a failure it migrates
