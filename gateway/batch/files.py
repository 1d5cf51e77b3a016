"""The Batch API's files on disk: input lines read where the store says they are, output and error files written
from the stored results page by page (bounded memory for any job size), fsynced, then renamed into place."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import IO, Any

from gateway.batch.store import BatchStore, Job
from policies.batch import EXPIRED_MESSAGE, LineError, check_line, duplicate_error, failed_line

_EXPORT_PAGE = 1000
CHUNK_BYTES = 4 * 1024 * 1024  # input read per validation step, at most (and at least one line)


def read_lines(path: Path, pos: int, limit: int, max_bytes: int = CHUNK_BYTES) -> list[tuple[int, bytes]]:
    """Up to `limit` lines from byte `pos` on, stopping after `max_bytes` (at least one line): (start offset, the
    line with its newline)."""
    out, size = [], 0
    with open(path, "rb") as f:
        f.seek(pos)
        while len(out) < limit and size < max_bytes:
            raw = f.readline()
            if not raw:
                break
            out.append((pos, raw))
            pos += len(raw)
            size += len(raw)
    return out


class LineScan:
    """Validation of one input file, a chunk at a time (each chunk in a worker thread: parsing 50,000 lines must not
    hold the event loop). Line numbers are the file's, blank lines counted; the custom_ids seen so far are kept to
    find duplicates (bounded by batch.max_requests)."""

    def __init__(self, endpoint: str, served: frozenset[str], max_body_bytes: int) -> None:
        self.endpoint, self.served, self.max_body_bytes = endpoint, served, max_body_bytes
        self.errors: list[LineError] = []
        self.seen: set[str] = set()
        self.pos = self.line_no = self.requests = 0

    def next_chunk(self, path: Path, limit: int) -> list[tuple[int, str, str, int, int]] | None:
        """The valid lines of the next `limit` lines as store rows (line_no, custom_id, group, offset, length);
        None at the end of the file."""
        chunk = read_lines(path, self.pos, limit)
        if not chunk:
            return None
        rows = []
        for start, raw in chunk:
            self.pos, self.line_no = start + len(raw), self.line_no + 1
            if not raw.strip():
                continue
            self.requests += 1
            checked = check_line(self.line_no, raw.rstrip(b"\r\n"), self.endpoint, self.served, self.max_body_bytes)
            if not isinstance(checked, LineError) and checked.custom_id in self.seen:
                checked = duplicate_error(self.line_no, checked.custom_id)
            if isinstance(checked, LineError):
                self.errors.append(checked)
                continue
            self.seen.add(checked.custom_id)
            rows.append((self.line_no, checked.custom_id, checked.group, start, len(raw)))
        return rows


def read_at(path: Path, pos: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(pos)
        return f.read(length)


def file_object(file_id: str, size: int, filename: str, purpose: str) -> dict[str, Any]:
    """A file as OpenAI shows it."""
    return {"id": file_id, "object": "file", "bytes": size, "created_at": int(time.time()), "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}


async def write_outputs(store: BatchStore, job: Job, folder: Path, expired: bool) -> tuple[str | None, str | None, int]:
    """(output file id, error file id, lines marked `batch_expired`). A file with no line is not created. The ids
    follow from the batch's, so a finalization cut short and run again replaces the same files."""
    paths = {kind: folder / f"file-{job.id}-{kind}.jsonl" for kind in ("output", "error")}
    tmp = f".{uuid.uuid4().hex[:8]}.tmp"  # a writer of its own, should another gateway take the job over meanwhile
    handles = {kind: open(str(p) + tmp, "wb") for kind, p in paths.items()}  # noqa: SIM115 - closed below
    counts, expired_n, after = {"output": 0, "error": 0}, 0, 0
    try:
        while page := await store.export_page(job.id, after, _EXPORT_PAGE):
            after = page[-1].line_no
            for row in page:
                if row.line is not None:
                    kind = "output" if row.ok else "error"
                    await asyncio.to_thread(handles[kind].write, row.line + b"\n")
                elif expired:
                    kind, expired_n = "error", expired_n + 1
                    line = failed_line(f"batch_req_{job.id}_{row.line_no}", row.custom_id, "batch_expired",
                                       EXPIRED_MESSAGE)
                    await asyncio.to_thread(handles[kind].write, line + b"\n")
                else:
                    continue
                counts[kind] += 1
    finally:
        for f in handles.values():
            await asyncio.to_thread(_close_synced, f)
    ids = {kind: await _publish(store, job, kind, paths[kind], tmp) if counts[kind] else None for kind in paths}
    for kind in paths:
        Path(str(paths[kind]) + tmp).unlink(missing_ok=True)  # an empty file is not published
    return ids["output"], ids["error"], expired_n


def _close_synced(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


async def _publish(store: BatchStore, job: Job, kind: str, path: Path, tmp: str) -> str:
    os.replace(str(path) + tmp, path)
    file_id = path.stem
    obj = file_object(file_id, path.stat().st_size, f"batch_{job.id}_{kind}.jsonl", "batch_output")
    await store.add_file(obj, job.owner, str(path))
    return file_id
