"""A PostgreSQL database of its own for a test: a fresh schema in the `test` database at 127.0.0.1:5432 (trust auth,
as on CI), dropped afterwards; the test is skipped where no server answers."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

PG = "postgresql://127.0.0.1:5432/test"


@contextmanager
def pg_schema() -> Iterator[str]:
    """A connection URL whose tables live in a fresh schema (libpq `options=-csearch_path=...`)."""
    psycopg = pytest.importorskip("psycopg")
    name = f"m3gate_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(PG, autocommit=True, connect_timeout=2) as conn:
            conn.execute(f"CREATE SCHEMA {name}")
    except psycopg.OperationalError:
        pytest.skip("no PostgreSQL at 127.0.0.1:5432")
    try:
        yield f"{PG}?options=-csearch_path%3D{name}"
    finally:
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {name} CASCADE")
