"""The Batch API's HTTP endpoints, shaped as OpenAI's: /v1/files (upload, list, get, content, delete) and /v1/batches
(create, get, list, cancel).

Access: a client key sees only the files and batches it created (anything else is a 404, as if it did not exist);
the admin key (`admin.api_key`) sees and cancels all of them but creates nothing. On a gateway without client keys
everyone is the same anonymous owner. Every batch object carries an `m3gate` field next to OpenAI's (the SDKs keep
extra fields): its deadline outlook (docs/batch.md, Deadlines). Uploads stream to disk (Starlette's multipart parser spools to a temporary
file); one larger than `batch.max_file_bytes` or with more than `batch.max_requests` lines gets a 413.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import time
import uuid
from pathlib import Path
from typing import IO, Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from gateway.access import presented_key
from gateway.batch.files import file_object
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore
from gateway.bodies import parse_json_object, receive_body
from gateway.errors import error_response, rejected_response
from gateway.runtime import Gateway
from policies.batch import check_endpoint, check_window
from policies.errors import RequestRejected

_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # the ids this API hands out are of this shape; anything else exists nowhere
_COPY_CHUNK = 1024 * 1024
_MULTIPART_SLACK = 64 * 1024  # the form's own bytes around the file


def _runner(request: Request) -> BatchRunner:
    runner: BatchRunner = request.app.state.batch
    return runner


def _store(request: Request) -> BatchStore:
    store = _runner(request).store
    assert store is not None
    return store


def _owner(request: Request) -> str | None:
    """Whose files and batches this caller sees: its key's name ("" on an open gateway), or None: all (the admin
    key)."""
    gw: Gateway = request.app.state.gateway
    admin = gw.config.admin.api_key
    presented = presented_key(request.headers)
    if admin is not None and presented is not None and hmac.compare_digest(
            presented.encode(), admin.get_secret_value().encode()):
        return None
    return gw.traffic.authenticate(request).name if not gw.traffic.keys.open else ""


def _creator(request: Request) -> str:
    owner = _owner(request)
    if owner is None:
        raise RequestRejected("The admin key reads and cancels batches; create files and batches with a client key.",
                              status=403, type="permission_error", code="admin_cannot_create")
    return owner


def _id(value: str | None) -> str | None:
    """An id from a path or query, or None when it cannot be one (never reaches the store: PostgreSQL refuses NUL)."""
    return value if value is not None and _ID.fullmatch(value) else None


def _not_found(kind: str, ident: str) -> Response:
    return error_response(404, f"No {kind} with id '{ident}' exists (or it belongs to another key).",
                          "invalid_request_error", param="id", code="not_found")


def _handled(handler: Any) -> Any:
    """Turns a RequestRejected into its OpenAI-shaped response."""
    async def endpoint(request: Request) -> Response:
        try:
            response: Response = await handler(request)
            return response
        except RequestRejected as exc:
            return rejected_response(exc)
    endpoint.__name__ = handler.__name__
    return endpoint


def _limit(request: Request, default: int = 20, most: int = 100) -> int:
    raw = request.query_params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise RequestRejected(f"limit must be an integer from 1 to {most}; got {raw!r}.", param="limit",
                              code="invalid_value")
    return int(raw)


# files ---------------------------------------------------------------------------------------------------------
async def upload_file(request: Request) -> Response:
    owner = _creator(request)
    cfg = request.app.state.gateway.config.batch
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cfg.max_file_bytes + _MULTIPART_SLACK:
        raise _too_large(cfg.max_file_bytes)
    async with request.form(max_files=1, max_fields=8) as form:
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise RequestRejected(f"purpose must be 'batch'; got {purpose!r}.", param="purpose", code="invalid_value")
        if not isinstance(upload, UploadFile):
            raise RequestRejected("Send the file as the multipart field `file`.", param="file",
                                  code="missing_required_parameter")
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        path = _runner(request).files_dir / f"{file_id}.jsonl"
        size = await _save(upload, path, cfg.max_file_bytes, cfg.max_requests)
    obj = file_object(file_id, size, upload.filename or "input.jsonl", "batch")
    await _store(request).add_file(obj, owner, str(path))
    return JSONResponse(obj)


async def _save(upload: UploadFile, path: Path, max_bytes: int, max_lines: int) -> int:
    """Copies the upload to `path` chunk by chunk; a file over either limit is removed and refused (413)."""
    size = lines = 0
    last = b"\n"
    out: IO[bytes] = await asyncio.to_thread(open, path, "wb")
    try:
        while chunk := await upload.read(_COPY_CHUNK):
            size += len(chunk)
            lines += chunk.count(b"\n")
            last = chunk[-1:]
            if size > max_bytes:
                raise _too_large(max_bytes)
            if lines > max_lines:
                raise _too_many(max_lines)
            await asyncio.to_thread(out.write, chunk)
        if lines + (last != b"\n") > max_lines:
            raise _too_many(max_lines)
        await asyncio.to_thread(out.flush)
        await asyncio.to_thread(os.fsync, out.fileno())
    except BaseException:
        out.close()
        path.unlink(missing_ok=True)
        raise
    out.close()
    return size


def _too_large(limit: int) -> RequestRejected:
    return RequestRejected(f"The file is larger than this gateway's limit of {limit:,} bytes (batch.max_file_bytes); "
                           "split it into smaller batches.", status=413, param="file", code="file_too_large")


def _too_many(limit: int) -> RequestRejected:
    return RequestRejected(f"The file has more than {limit:,} requests, this gateway's limit (batch.max_requests); "
                           "split it into smaller batches.", status=413, param="file", code="too_many_requests")


async def list_files(request: Request) -> Response:
    limit = _limit(request, 10_000, 10_000)
    purpose, after = request.query_params.get("purpose"), request.query_params.get("after")
    data = await _store(request).list_files(_owner(request), _id(purpose) or ("-" if purpose else None), limit + 1,
                                            _id(after) or ("-" if after else None))
    return JSONResponse(_page(data[:limit], len(data) > limit))


async def get_file(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    found = await _store(request).get_file(file_id, _owner(request)) if _id(file_id) else None
    return JSONResponse(found[0]) if found else _not_found("file", file_id)


async def file_content(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    found = await _store(request).get_file(file_id, _owner(request)) if _id(file_id) else None
    if found is None or not Path(found[1]).exists():
        return _not_found("file", file_id)
    return FileResponse(found[1], media_type="application/jsonl")


async def delete_file(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    store = _store(request)
    found = await store.get_file(file_id, _owner(request)) if _id(file_id) else None
    if found is None:
        return _not_found("file", file_id)
    await store.delete_file(file_id)
    await asyncio.to_thread(Path(found[1]).unlink, True)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# batches -------------------------------------------------------------------------------------------------------
async def create_batch(request: Request) -> Response:
    owner = _creator(request)
    gw: Gateway = request.app.state.gateway
    body = parse_json_object(await receive_body(request, gw.config.server.max_body_bytes, gw.traffic.body_deadline))
    endpoint = check_endpoint(body.get("endpoint"))
    window = check_window(body.get("completion_window"), gw.config.batch.completion_windows)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(v, str) for v in metadata.values())):
        raise RequestRejected("metadata must be an object of at most 16 string values.", param="metadata",
                              code="invalid_value")
    input_id = body.get("input_file_id")
    found = await _store(request).get_file(input_id, owner) if isinstance(input_id, str) and _id(input_id) else None
    if found is None or found[0]["purpose"] != "batch":
        raise RequestRejected(f"input_file_id {input_id!r} names no file with purpose 'batch' of this key.",
                              status=404 if found is None else 400, param="input_file_id", code="not_found")
    obj = _new_batch(endpoint, str(input_id), body["completion_window"], window, metadata)
    await _store(request).add_batch(obj, owner, obj["expires_at"])
    _runner(request).wake()
    return JSONResponse(_shown(request, obj))


def _new_batch(endpoint: str, input_id: str, window_text: str, window_s: float, metadata: Any) -> dict[str, Any]:
    now = int(time.time())
    return {"id": f"batch_{uuid.uuid4().hex[:24]}", "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_id, "completion_window": window_text, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + int(window_s), "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}


async def get_batch(request: Request) -> Response:
    batch_id = request.path_params["batch_id"]
    found = await _store(request).get_batch(batch_id, _owner(request)) if _id(batch_id) else None
    return JSONResponse(_shown(request, found)) if found else _not_found("batch", batch_id)


async def list_batches(request: Request) -> Response:
    limit = _limit(request)
    after = request.query_params.get("after")
    data = await _store(request).list_batches(_owner(request), limit + 1, _id(after) or ("-" if after else None))
    return JSONResponse(_page([_shown(request, b) for b in data[:limit]], len(data) > limit))


async def cancel_batch(request: Request) -> Response:
    batch_id = request.path_params["batch_id"]
    store = _store(request)
    found = await store.get_batch(batch_id, _owner(request)) if _id(batch_id) else None
    if found is None:
        return _not_found("batch", batch_id)
    changed = await store.update_batch(batch_id, {"status": "cancelling", "cancelling_at": int(time.time())},
                                       only_from=("validating", "in_progress"))
    if changed is None and found["status"] not in ("cancelling", "cancelled"):
        return error_response(409, f"Batch {batch_id} is {found['status']}; only a validating or in-progress batch "
                              "can be cancelled.", "invalid_request_error", code="batch_not_cancellable")
    _runner(request).wake()
    return JSONResponse(_shown(request, changed or found))


def _shown(request: Request, batch: dict[str, Any]) -> dict[str, Any]:
    """The batch object as answered: OpenAI's fields and `m3gate`, its deadline outlook (not stored: each
    gateway forecasts every job in progress)."""
    return {**batch, "m3gate": _runner(request).outlook(batch["id"])}


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def batch_routes() -> list[Route]:
    return [
        Route("/v1/files", _handled(upload_file), methods=["POST"]),
        Route("/v1/files", _handled(list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", _handled(get_file), methods=["GET"]),
        Route("/v1/files/{file_id}", _handled(delete_file), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", _handled(file_content), methods=["GET"]),
        Route("/v1/batches", _handled(create_batch), methods=["POST"]),
        Route("/v1/batches", _handled(list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", _handled(get_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", _handled(cancel_batch), methods=["POST"]),
    ]
