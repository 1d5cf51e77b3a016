"""Traces and metrics for each request, built from its `RequestRecord` (placeholder: filled in by the
observability work). The gateway calls exactly three hooks per request: `start`, `inject`, `finish`."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from gateway.relay import RequestRecord


class Telemetry:
    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway

    def start(self, record: RequestRecord, headers: Mapping[str, str]) -> None:
        """At arrival: begin the server span (honouring an incoming traceparent)."""

    def inject(self, record: RequestRecord, headers: MutableMapping[str, str]) -> None:
        """Before each upstream attempt: add traceparent so vLLM's own span joins the trace."""

    def finish(self, record: RequestRecord) -> None:
        """Once, when the request is over however it ended: spans and histograms from the record's timestamps."""

    async def shutdown(self) -> None:
        """Flush exporters."""
