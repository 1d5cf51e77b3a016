"""Failure injection for chaos tests: what the replica should do wrong, switchable at start and at run time.

`FaultSettings` is the immutable value (flags, JSON); `Faults` is the live, per-app holder the routes consult.
Randomness comes from an owned `random.Random` so a seeded replica fails reproducibly.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class FaultSettings:
    error_rate: float = 0.0  # share of generate requests answered with vLLM's 500 InternalServerError
    added_latency_ms: float = 0.0  # extra delay before a generate request is handled
    hang: bool = False  # generate requests are accepted and never answered (until the client gives up)
    drop_mid_stream: float = 0.0  # share of generate responses whose connection is cut after a few chunks
    drop_after_chunks: int | None = None  # with drop_mid_stream: cut after exactly this many chunks (0: before any)
    refuse_connections: bool = False  # stop listening: new connections are refused (ECONNREFUSED)
    refuse_for_s: float | None = None  # with refuse_connections: listen again after this many seconds
    unhealthy: bool = False  # /health answers 503 while requests are still served


class FaultUpdate(BaseModel):
    """Body of POST /sim/faults: a partial update, unknown keys rejected so typos do not pass silently."""

    model_config = ConfigDict(extra="forbid")

    error_rate: float | None = Field(default=None, ge=0, le=1)
    added_latency_ms: float | None = Field(default=None, ge=0)
    hang: bool | None = None
    drop_mid_stream: float | None = Field(default=None, ge=0, le=1)
    drop_after_chunks: int | None = Field(default=None, ge=0)
    refuse_connections: bool | None = None
    refuse_for_s: float | None = Field(default=None, gt=0)
    unhealthy: bool | None = None


class Faults:
    """The replica's current faults. Mutated only by the admin route; read by every route."""

    def __init__(self, initial: FaultSettings, seed: int) -> None:
        self.current = initial
        self._rng = random.Random(seed ^ 0x5EED)

    def update(self, patch: FaultUpdate) -> FaultSettings:
        changes = {f.name: getattr(patch, f.name) for f in fields(FaultSettings) if f.name in patch.model_fields_set}
        if "refuse_connections" in changes and not changes["refuse_connections"] and "refuse_for_s" not in changes:
            changes["refuse_for_s"] = None
        self.current = replace(self.current, **changes)
        return self.current

    def as_json(self) -> dict[str, Any]:
        return asdict(self.current)

    def should_error(self) -> bool:
        rate = self.current.error_rate
        return rate > 0 and self._rng.random() < rate

    def should_drop(self) -> bool:
        rate = self.current.drop_mid_stream
        return rate > 0 and self._rng.random() < rate
