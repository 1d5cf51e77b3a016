"""gateway/batch/store.py on a real SQLite file and a real PostgreSQL database (127.0.0.1:5432, database `test`, a
schema of its own per test; skipped where none answers): a result is kept once per custom_id and counted once, leases pass
to another holder only when they run out, pending lines come in prefix-group order, pages follow OpenAI's cursor,
and the owner filter hides other keys' objects."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from gateway.batch.store import BatchStore
from tests.support.postgres import pg_schema


def _batch(batch_id: str, status: str = "validating") -> dict[str, Any]:
    return {"id": batch_id, "object": "batch", "status": status, "endpoint": "/v1/chat/completions"}


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    with ExitStack() as stack:
        url = stack.enter_context(pg_schema()) if request.param == "postgresql" else \
            f"sqlite:///{tmp_path / 'batch.sqlite3'}"
        s = BatchStore(url)
        await s.open()
        yield s
        await s.close()


async def test_a_result_is_kept_and_counted_once(store: BatchStore) -> None:
    await store.add_batch(_batch("b1", "in_progress"), "alice", 100.0)
    await store.add_lines("b1", [(1, "x", "g", 0, 10), (2, "y", "g", 10, 10)])
    await store.set_total("b1", 2)
    assert await store.record_result("b1", 1, "x", True, b'{"first": 1}')
    assert not await store.record_result("b1", 1, "x", False, b'{"again": 1}')  # a line run again after a restart
    assert [p.custom_id for p in await store.pending("b1", 10)] == ["y"]
    batch = await store.get_batch("b1", None)
    assert batch is not None and batch["request_counts"] == {"total": 2, "completed": 1, "failed": 0}
    rows = await store.export_page("b1", 0, 10)
    assert [(r.custom_id, r.ok, r.line) for r in rows] == [("x", 1, b'{"first": 1}'), ("y", None, None)]


async def test_the_schema_survives_a_reopen(tmp_path: Path) -> None:
    """Opening an existing store keeps its rows (the schema is created only where missing)."""
    first = BatchStore(f"sqlite:///{tmp_path / 's.sqlite3'}")
    await first.open()
    await first.add_batch(_batch("b1"), "alice", 100.0)
    await first.close()
    again = BatchStore(f"sqlite:///{tmp_path / 's.sqlite3'}")
    await again.open()
    assert (await again.get_batch("b1", "alice") or {})["id"] == "b1"
    await again.close()


async def test_pending_lines_come_by_prefix_group_then_file_order(store: BatchStore) -> None:
    await store.add_batch(_batch("b1", "in_progress"), "alice", 100.0)
    await store.add_lines("b1", [(1, "a", "g2", 0, 1), (2, "b", "g1", 1, 1), (3, "c", "g2", 2, 1),
                                 (4, "d", "g1", 3, 1)])
    assert [p.custom_id for p in await store.pending("b1", 10)] == ["b", "d", "a", "c"]
    assert [p.custom_id for p in await store.pending("b1", 2)] == ["b", "d"]


async def test_leases_pass_only_when_they_run_out(store: BatchStore) -> None:
    await store.add_batch(_batch("b1"), "alice", 200.0)
    await store.add_batch(_batch("b0"), "alice", 100.0)
    await store.add_batch(_batch("done", "completed"), "alice", 50.0)
    assert [j.id for j in await store.claim("gw-a", now=1000.0, lease_s=30.0)] == ["b0", "b1"]  # earliest first
    assert await store.claim("gw-b", now=1010.0, lease_s=30.0) == []  # gw-a's leases still run
    assert len(await store.claim("gw-a", now=1020.0, lease_s=30.0)) == 2  # renewed until 1050
    assert await store.claim("gw-b", now=1045.0, lease_s=30.0) == []
    assert [j.id for j in await store.claim("gw-b", now=1051.0, lease_s=30.0)] == ["b0", "b1"]  # gw-a died
    await store.release("gw-b")
    assert len(await store.claim("gw-c", now=1052.0, lease_s=30.0)) == 2  # a clean stop hands over at once


async def test_owners_see_only_their_own_and_pages_follow_the_cursor(store: BatchStore) -> None:
    for i in range(5):
        await store.add_batch(_batch(f"b{i}"), "alice" if i % 2 == 0 else "bob", 100.0)
    assert await store.get_batch("b1", "alice") is None and await store.get_batch("b1", None) is not None
    assert [b["id"] for b in await store.list_batches("alice", 10, None)] == ["b4", "b2", "b0"]
    assert [b["id"] for b in await store.list_batches(None, 2, "b3")] == ["b2", "b1"]


async def test_update_only_from_the_statuses_given(store: BatchStore) -> None:
    await store.add_batch(_batch("b1", "completed"), "alice", 100.0)
    assert await store.update_batch("b1", {"status": "cancelling"}, only_from=("in_progress",)) is None
    changed = await store.update_batch("b1", {"output_file_id": "f"}, failed_extra=3)
    assert changed is not None and changed["status"] == "completed" and changed["request_counts"]["failed"] == 3
