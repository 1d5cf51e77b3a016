"""The OpenAI Batch API (docs/batch.md): `api` (the HTTP endpoints) > `runner` (runs the jobs through the gateway's
own request path) > `files`, `telemetry` > `store` (SQLite: files, jobs, lines, results, leases)."""

from gateway.batch.api import batch_routes
from gateway.batch.runner import BatchRunner

__all__ = ["BatchRunner", "batch_routes"]
