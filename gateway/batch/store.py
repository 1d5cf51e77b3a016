"""The Batch API's store of record: files, batches, each job's lines and each line's result, in SQLite (one gateway)
or PostgreSQL (gateways sharing the jobs).

SQLite is the stdlib `sqlite3`, PostgreSQL is psycopg 3; both are called from a worker thread (`asyncio.to_thread`)
over one connection behind a lock. aiosqlite would do the same (a thread per connection) with one more dependency,
and one code path serves both databases. SQLite runs in WAL mode with `synchronous=FULL`: a result is on disk before
the line counts as done, so a gateway killed at any point loses only the lines in flight (run again after restart).

Exactly once: a result row's key is (batch, custom_id), inserted with ON CONFLICT DO NOTHING in the same transaction
that marks the line done and counts it; a line run twice (after a restart) keeps its first result. Leases: a job is
worked on by the gateway whose lease on it is current (rows claimed with FOR UPDATE SKIP LOCKED on PostgreSQL); a
gateway that stops renewing loses it after `lease_s`. Bounded memory: lines and results are read in pages.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

import orjson

from policies.batch import ACTIVE_STATUSES

T = TypeVar("T")
SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS m3gate_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batch_files (
    seq {serial}, id TEXT NOT NULL UNIQUE, owner TEXT NOT NULL, purpose TEXT NOT NULL, obj TEXT NOT NULL,
    path TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batch_jobs (
    seq {serial}, id TEXT NOT NULL UNIQUE, owner TEXT NOT NULL, status TEXT NOT NULL, obj TEXT NOT NULL,
    expires_at {real} NOT NULL, lease_owner TEXT, lease_until {real} NOT NULL DEFAULT 0,
    total BIGINT NOT NULL DEFAULT 0, completed BIGINT NOT NULL DEFAULT 0, failed BIGINT NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS batch_jobs_status ON batch_jobs (status);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line_no BIGINT NOT NULL, custom_id TEXT NOT NULL, grp TEXT NOT NULL,
    pos BIGINT NOT NULL, length BIGINT NOT NULL, done SMALLINT NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, line_no));
CREATE INDEX IF NOT EXISTS batch_lines_pending ON batch_lines (batch_id, done, grp, line_no);
CREATE TABLE IF NOT EXISTS batch_results (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, line_no BIGINT NOT NULL, ok SMALLINT NOT NULL,
    line {blob} NOT NULL, PRIMARY KEY (batch_id, custom_id));
CREATE INDEX IF NOT EXISTS batch_results_order ON batch_results (batch_id, line_no)
"""


class Db:
    """One connection to SQLite or PostgreSQL, spoken to in one SQL: `?` placeholders (PostgreSQL's `%s` is
    substituted), ON CONFLICT, and `{lock}` where a row lock belongs (PostgreSQL: FOR UPDATE SKIP LOCKED, so two
    gateways claiming at once never wait for each other; SQLite has one writer at a time and needs none)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.postgres = url.startswith(("postgresql://", "postgres://"))
        self._conn: Any = None

    def connect(self) -> None:
        if self.postgres:
            import psycopg  # only a PostgreSQL store needs the driver

            self._conn = psycopg.connect(self.url, autocommit=True)
            self.execute("BEGIN")
            self.execute("SELECT pg_advisory_xact_lock(4242001)")  # gateways starting together migrate in turn
            self._schema("BIGSERIAL PRIMARY KEY", "DOUBLE PRECISION", "BYTEA")
            self.execute("COMMIT")
        else:
            path = self.url.removeprefix("sqlite:///")
            self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30.0)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._schema("INTEGER PRIMARY KEY AUTOINCREMENT", "REAL", "BLOB")

    def _schema(self, serial: str, real: str, blob: str) -> None:
        for statement in _SCHEMA.format(serial=serial, real=real, blob=blob).split(";"):
            self.execute(statement)
        row = self.execute("SELECT value FROM m3gate_meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            self.execute("INSERT INTO m3gate_meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) > SCHEMA_VERSION:
            raise RuntimeError(f"the batch store has schema {row[0]}; this m3gate knows {SCHEMA_VERSION}")

    def execute(self, sql: str, params: Iterable[Any] = ()) -> Any:
        return self._conn.execute(self._sql(sql), tuple(params))

    def executemany(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        if self.postgres:
            with self._conn.cursor() as cur:
                cur.executemany(self._sql(sql), rows)
        else:
            self._conn.executemany(self._sql(sql), rows)

    def begin(self) -> None:
        self.execute("BEGIN" if self.postgres else "BEGIN IMMEDIATE")  # SQLite: the write lock at once

    def _sql(self, sql: str) -> str:
        sql = sql.replace("{lock}", " FOR UPDATE SKIP LOCKED" if self.postgres else "")
        return sql.replace("?", "%s") if self.postgres else sql

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class PendingLine(NamedTuple):
    line_no: int
    custom_id: str
    group: str  # prefix group
    pos: int  # byte offset of the line in the input file
    length: int


class Job(NamedTuple):
    """What the runner needs of a batch it holds the lease on."""

    id: str
    owner: str
    status: str
    expires_at: float
    obj: dict[str, Any]


class ExportRow(NamedTuple):
    line_no: int
    custom_id: str
    ok: int | None  # None: the line has no result (cancelled or expired before it ran)
    line: bytes | None


class BatchStore:
    """The store at `url` (sqlite:///PATH or postgresql://...); every method is a coroutine that runs its SQL in a
    worker thread, one call at a time."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._db: Db | None = None
        self._lock = threading.Lock()

    # lifecycle -------------------------------------------------------------------------------------------------
    async def open(self) -> None:
        """Connects, creates or migrates the schema."""
        db = Db(self.url)
        await asyncio.to_thread(db.connect)
        self._db = db

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            await asyncio.to_thread(db.close)

    async def _run(self, fn: Callable[[Db], T]) -> T:
        def locked() -> T:
            assert self._db is not None, "batch store not open"
            with self._lock:
                return fn(self._db)
        return await asyncio.to_thread(locked)

    async def _write(self, fn: Callable[[Db], T]) -> T:
        """`fn` in one transaction."""
        def tx(db: Db) -> T:
            db.begin()
            try:
                out = fn(db)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return out
        return await self._run(tx)

    # files -----------------------------------------------------------------------------------------------------
    async def add_file(self, obj: dict[str, Any], owner: str, path: str) -> None:
        """A file's row (again: replaced, so that a finalization cut short and run again keeps one row)."""
        await self._write(lambda db: db.execute(
            "INSERT INTO batch_files (id, owner, purpose, obj, path) VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO "
            "UPDATE SET obj = excluded.obj, path = excluded.path",
            (obj["id"], owner, obj["purpose"], orjson.dumps(obj).decode(), path)))

    async def get_file(self, file_id: str, owner: str | None) -> tuple[dict[str, Any], str] | None:
        """The file object and its path on disk; None when it does not exist or `owner` (None: anyone) lacks it."""
        row = await self._run(lambda db: db.execute(
            "SELECT obj, path, owner FROM batch_files WHERE id = ?", (file_id,)).fetchone())
        if row is None or (owner is not None and row[2] != owner):
            return None
        return orjson.loads(row[0]), row[1]

    async def list_files(self, owner: str | None, purpose: str | None, limit: int, after: str | None) -> \
            list[dict[str, Any]]:
        rows = await self._run(lambda db: _page(db, "batch_files", owner, limit, after,
                                                ("purpose = ?", purpose) if purpose else None))
        return [orjson.loads(r[0]) for r in rows]

    async def delete_file(self, file_id: str) -> None:
        await self._write(lambda db: db.execute("DELETE FROM batch_files WHERE id = ?", (file_id,)))

    # batches ---------------------------------------------------------------------------------------------------
    async def add_batch(self, obj: dict[str, Any], owner: str, expires_at: float) -> None:
        await self._write(lambda db: db.execute(
            "INSERT INTO batch_jobs (id, owner, status, obj, expires_at) VALUES (?, ?, ?, ?, ?)",
            (obj["id"], owner, obj["status"], orjson.dumps(obj).decode(), expires_at)))

    async def get_batch(self, batch_id: str, owner: str | None) -> dict[str, Any] | None:
        row = await self._run(lambda db: db.execute(
            f"SELECT {_BATCH_COLUMNS}, owner FROM batch_jobs WHERE id = ?", (batch_id,)).fetchone())
        if row is None or (owner is not None and row[-1] != owner):
            return None
        return _batch_object(row)

    async def list_batches(self, owner: str | None, limit: int, after: str | None) -> list[dict[str, Any]]:
        rows = await self._run(lambda db: _page(db, "batch_jobs", owner, limit, after, None, _BATCH_COLUMNS))
        return [_batch_object(r) for r in rows]

    async def update_batch(self, batch_id: str, changes: dict[str, Any], *, only_from: Iterable[str] = (),
                           failed_extra: int = 0) -> dict[str, Any] | None:
        """Merge `changes` into the batch object (its `status` into the column too); with `only_from`, only while
        the batch is in one of those statuses; `failed_extra` lines more count as failed (expired ones). Returns the
        new object, or None when nothing changed."""
        allowed = tuple(only_from)

        def update(db: Db) -> dict[str, Any] | None:
            row = db.execute(f"SELECT {_BATCH_COLUMNS} FROM batch_jobs WHERE id = ?", (batch_id,)).fetchone()
            if row is None or (allowed and row[1] not in allowed):
                return None
            obj = orjson.dumps({**orjson.loads(row[0]), **changes}).decode()
            status = changes.get("status", row[1])
            db.execute("UPDATE batch_jobs SET obj = ?, status = ?, failed = failed + ? WHERE id = ?",
                       (obj, status, failed_extra, batch_id))
            return _batch_object((obj, status, row[2], row[3], row[4] + failed_extra))
        return await self._write(update)

    async def active_batches(self, limit: int = 50) -> list[tuple[str, dict[str, Any]]]:
        """(owner, batch) of the unfinished jobs, oldest first: the status page's list."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        rows = await self._run(lambda db: db.execute(
            f"SELECT {_BATCH_COLUMNS}, owner FROM batch_jobs WHERE status IN ({marks}) ORDER BY seq LIMIT ?",
            (*ACTIVE_STATUSES, limit)).fetchall())
        return [(r[-1], _batch_object(r)) for r in rows]

    async def counts_by_status(self) -> dict[str, int]:
        rows = await self._run(lambda db: db.execute(
            "SELECT status, COUNT(*) FROM batch_jobs GROUP BY status").fetchall())
        return {status: int(n) for status, n in rows}

    # leases ----------------------------------------------------------------------------------------------------
    async def claim(self, holder: str, now: float, lease_s: float) -> list[Job]:
        """Take (or renew) the lease on every unfinished job whose lease is free, expired or already ours; the jobs
        now held, earliest deadline first."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))

        def claim(db: Db) -> list[Job]:
            db.execute(f"UPDATE batch_jobs SET lease_owner = ?, lease_until = ? WHERE id IN (SELECT id FROM batch_jobs "
                       f"WHERE status IN ({marks}) AND (lease_owner IS NULL OR lease_owner = ? OR lease_until < ?)"
                       "{lock})", (holder, now + lease_s, *ACTIVE_STATUSES, holder, now))
            rows = db.execute(f"SELECT id, owner, status, expires_at, obj FROM batch_jobs WHERE lease_owner = ? "
                              f"AND status IN ({marks}) ORDER BY expires_at, id", (holder, *ACTIVE_STATUSES))
            return [Job(r[0], r[1], r[2], r[3], orjson.loads(r[4])) for r in rows.fetchall()]
        return await self._write(claim)

    async def release(self, holder: str) -> None:
        """Give up every lease at once (a clean stop): another gateway, or this one restarted, takes over now."""
        await self._write(lambda db: db.execute(
            "UPDATE batch_jobs SET lease_owner = NULL, lease_until = 0 WHERE lease_owner = ?", (holder,)))

    # lines and results -----------------------------------------------------------------------------------------
    async def add_lines(self, batch_id: str, rows: list[tuple[int, str, str, int, int]]) -> None:
        """(line_no, custom_id, group, pos, length) rows of a job being validated (again after a restart: kept)."""
        await self._write(lambda db: db.executemany(
            "INSERT INTO batch_lines (batch_id, line_no, custom_id, grp, pos, length) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING", [(batch_id, *r) for r in rows]))

    async def set_total(self, batch_id: str, total: int) -> None:
        await self._write(lambda db: db.execute("UPDATE batch_jobs SET total = ? WHERE id = ?", (total, batch_id)))

    async def pending(self, batch_id: str, limit: int) -> list[PendingLine]:
        """Lines without a result, in dispatch order: by prefix group, then as in the file."""
        rows = await self._run(lambda db: db.execute(
            "SELECT line_no, custom_id, grp, pos, length FROM batch_lines WHERE batch_id = ? AND done = 0 "
            "ORDER BY grp, line_no LIMIT ?", (batch_id, limit)).fetchall())
        return [PendingLine(*r) for r in rows]

    async def record_result(self, batch_id: str, line_no: int, custom_id: str, ok: bool, line: bytes) -> bool:
        """The line's result, durably and at most once; False when it already had one."""
        def record(db: Db) -> bool:
            cur = db.execute("INSERT INTO batch_results (batch_id, custom_id, line_no, ok, line) VALUES (?, ?, ?, ?, ?) "
                             "ON CONFLICT DO NOTHING", (batch_id, custom_id, line_no, int(ok), line))
            if cur.rowcount != 1:
                return False
            db.execute("UPDATE batch_lines SET done = 1 WHERE batch_id = ? AND line_no = ?", (batch_id, line_no))
            column = "completed" if ok else "failed"
            db.execute(f"UPDATE batch_jobs SET {column} = {column} + 1 WHERE id = ?", (batch_id,))
            return True
        return await self._write(record)

    async def export_page(self, batch_id: str, after_line: int, limit: int) -> list[ExportRow]:
        """Every line after `after_line` with its result, if any, in file order (the output files are written from
        these pages)."""
        rows = await self._run(lambda db: db.execute(
            "SELECT l.line_no, l.custom_id, r.ok, r.line FROM batch_lines l LEFT JOIN batch_results r "
            "ON r.batch_id = l.batch_id AND r.custom_id = l.custom_id WHERE l.batch_id = ? AND l.line_no > ? "
            "ORDER BY l.line_no LIMIT ?", (batch_id, after_line, limit)).fetchall())
        return [ExportRow(r[0], r[1], r[2], bytes(r[3]) if r[3] is not None else None) for r in rows]

    async def forget_lines(self, batch_id: str) -> None:
        """A finished job's lines and results (its output files hold them now)."""
        def forget(db: Db) -> None:
            db.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
            db.execute("DELETE FROM batch_results WHERE batch_id = ?", (batch_id,))
        await self._write(forget)


_BATCH_COLUMNS = "obj, status, total, completed, failed"


def _batch_object(row: tuple[Any, ...]) -> dict[str, Any]:
    """The batch as OpenAI shows it: the stored object with live request counts."""
    obj: dict[str, Any] = orjson.loads(row[0])
    obj["status"] = row[1]
    obj["request_counts"] = {"total": row[2], "completed": row[3], "failed": row[4]}
    return obj


def _page(db: Db, table: str, owner: str | None, limit: int, after: str | None,
          extra: tuple[str, Any] | None, columns: str = "obj") -> list[tuple[Any, ...]]:
    """Newest first, `limit` rows after the row with id `after` (OpenAI's cursor pagination)."""
    where, args = ["1 = 1"], []
    if owner is not None:
        where.append("owner = ?")
        args.append(owner)
    if extra is not None:
        where.append(extra[0])
        args.append(extra[1])
    if after:
        where.append(f"seq < COALESCE((SELECT seq FROM {table} WHERE id = ?), -1)")
        args.append(after)
    sql = f"SELECT {columns} FROM {table} WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT ?"
    return db.execute(sql, (*args, limit)).fetchall()
