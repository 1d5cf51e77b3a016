"""Routing state shared between gateway processes (placeholder: in-memory only; the Redis implementation follows).

What is shared: which replica each request's prefix blocks were sent to (so every gateway's prefix index learns it),
session pins, and each gateway's in-flight count per replica. The hot path only appends to a local buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from policies.snapshot import RoutingRequest


class SharedState(Protocol):
    available: bool

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def on_dispatch(self, pool: str, replica: str, request: RoutingRequest) -> None:
        """This gateway sent `request` to `replica` (called on the hot path: must not block or await)."""

    def remote_in_flight(self, replica: str) -> int:
        """In-flight requests other gateways currently have on `replica`."""


class LocalState:
    """No sharing: a single gateway process (or `state:` unset)."""

    available = True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def on_dispatch(self, pool: str, replica: str, request: RoutingRequest) -> None:
        return None

    def remote_in_flight(self, replica: str) -> int:
        return 0


ApplyRemote = Callable[[str, str, RoutingRequest], None]
"""How a remote dispatch is applied locally: (pool, replica url, request) → the pool policy's `dispatched`."""


def build_shared_state(url: str | None, apply_remote: ApplyRemote, local_in_flight: Callable[[], dict[str, int]]
                       ) -> SharedState:
    if not url:
        return LocalState()
    raise NotImplementedError("redis shared state is not implemented yet")
