"""The Batch API's runner: a background task of each gateway that leases jobs from the store and moves them along
validating → in_progress → finalizing → completed (or failed / expired / cancelled).

Each line runs through the gateway's own request path in-process (`Coordinator.serve` on an ASGI scope built here,
no HTTP to itself): the same admission, class queue, routing and telemetry as an online request, as the job's owner
(`IN_PROCESS_CLIENT`: its key's pools and token limits) in the `batch.class` traffic class. A line refused for
capacity (429, 503) is run again later, never written as a failure.

Order: jobs by earliest deadline first; within a job, lines by prefix group (policies/batch.py), so a group's
shared prefix stays cached on the replica that serves it.

Deadlines: every look at the store, each job in progress gets a forecast from its measured lines per second
(policies/batch_deadline.py); one predicted to miss its window gets a higher share step, which raises the batch
class's background window floor in this gateway's admission (still nothing without headroom), and back on track a
lower one. The batch object's `m3gate` field and the `m3gate_batch_*` deadline metrics say so. Cancel stops dispatching at once and lets the lines in
flight finish; so does the end of the completion window, whose unfinished lines get `batch_expired` errors.

Restart: a result is stored before its line counts as done; lines in flight at a kill have none and run again when
the job's lease is taken over (`batch.lease_s`). Output files are written at the end from the stored results, one
line per custom_id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.access import ANONYMOUS, IN_PROCESS_CLIENT, Client
from gateway.batch.files import LineScan, read_at, write_outputs
from gateway.batch.store import BatchStore, Job, PendingLine
from gateway.batch.telemetry import NO_OUTLOOK, BatchMetrics, JobOutlook
from gateway.coordinator import Coordinator
from gateway.runtime import Gateway
from policies.batch import (
    MAX_LINE_ERRORS,
    RETRY_STATUSES,
    JobDeadline,
    LineError,
    dispatch_order,
    failed_line,
    finish_estimate,
    lines_to_send,
    output_line,
)
from policies.batch_deadline import ShareStep, forecast, lane_floor, measured_rate, next_step
from policies.traffic import CLASS_HEADER

log = logging.getLogger("m3gate.batch")

APIS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses"}
RETRY_AFTER_S = 1.0
_VALIDATE_CHUNK = 2000  # lines read and stored per step while validating
_LOOK_AHEAD = 256  # pending lines read beyond the free slots, to find lines of warm groups behind a cold one
MIN_TICK_S = 0.05  # at most 20 ticks a second (each renews the leases: one write to the store)
PROGRESS_WINDOW_S = 60.0  # lines per second over this window (the status page's rate and predicted finish)


class BatchRunner:
    """Runs the jobs this gateway holds leases on; also owns the store and the files folder the API uses."""

    def __init__(self, gateway: Gateway, coordinator: Coordinator) -> None:
        self.gw = gateway
        self.coordinator = coordinator
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.files_dir = Path()
        self.store: BatchStore | None = None
        self.metrics = BatchMetrics()
        self._temp: str | None = None
        self._busy: dict[str, dict[int, str]] = {}  # batch id → line number in flight here → its prefix group
        self._warm: dict[str, set[str]] = {}  # batch id → prefix groups with an answer back (cached on a replica)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._steps: dict[str, asyncio.Task[None]] = {}  # batch id → its validation or finalization running now
        self._wake = asyncio.Event()
        self._active: list[tuple[str, dict[str, Any]]] = []  # (owner, batch) of unfinished jobs, at the last tick
        self._progress: dict[str, deque[tuple[float, int]]] = {}  # batch id → (time, lines done) samples
        self._sampled_at = float("-inf")
        self._shares: dict[str, ShareStep] = {}  # batch id → its share step (jobs in progress)
        self._floor_class: str | None = None  # the class whose lane floor this runner last set

    # lifecycle -------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.gw.config.batch
        if cfg.files_dir:
            self.files_dir = Path(cfg.files_dir)
        else:  # ephemeral: removed at stop
            self._temp = tempfile.mkdtemp(prefix="m3gate-batch-")
            self.files_dir = Path(self._temp)
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.store = open_store(cfg.store, self.files_dir)
        await self.store.open()
        if self.gw.telemetry.metrics is not None:
            self.gw.telemetry.metrics.registry.register(self.metrics)
        self._loop_task = asyncio.create_task(self._run(), name="m3gate-batch-runner")

    async def stop(self) -> None:
        """Stops dispatching and cuts the lines in flight (they have no result: they run again later), then gives
        the leases back so that a restarted gateway takes the jobs over at once."""
        tasks = [t for t in (self._loop_task, *self._tasks, *self._steps.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.release(self.holder)
            await self.store.close()
        if self._temp:
            shutil.rmtree(self._temp, ignore_errors=True)

    def wake(self) -> None:
        """Look for work now (a batch was created or cancelled, a line finished)."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a store hiccup must not end the runner
                log.exception("batch runner step failed")
            await asyncio.sleep(MIN_TICK_S)  # wakes coming closer (lines finishing) are served by one tick
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.gw.config.batch.poll_interval_s)

    async def tick(self) -> None:
        store = self._store()
        cfg = self.gw.config.batch
        jobs = {job.id: job for job in await store.claim(self.holder, time.time(), cfg.lease_s)}  # renews ours
        if time.monotonic() - self._sampled_at >= cfg.poll_interval_s:
            self._sampled_at = time.monotonic()
            self.metrics.jobs = await store.counts_by_status()
            await self._sample_progress(store)
            self._judge_deadlines(time.time(), set(jobs))
        for batch_id in dispatch_order(JobDeadline(job.id, job.expires_at) for job in jobs.values()):
            await self._advance(jobs[batch_id], time.time())

    async def _sample_progress(self, store: BatchStore) -> None:
        self._active = await store.active_batches()
        now = time.time()
        for _, batch in self._active:
            samples = self._progress.setdefault(batch["id"], deque())
            counts = batch["request_counts"]
            samples.append((now, counts["completed"] + counts["failed"]))
            while len(samples) > 2 and now - samples[0][0] > PROGRESS_WINDOW_S:
                samples.popleft()
        live = {batch["id"] for _, batch in self._active}
        for gone in [b for b in self._progress if b not in live]:
            del self._progress[gone]

    def _judge_deadlines(self, now: float, held: set[str]) -> None:
        """Each job in progress: its forecast and next share step; the steps of the jobs held here set the batch
        class's lane floor in this gateway's admission (every gateway judges every job, so each answers the
        `m3gate` field alike; only the one running a job counts its steps)."""
        rule = self.gw.config.batch.deadline
        min_span = min(rule.step_interval_s, PROGRESS_WINDOW_S)
        outlooks: dict[str, JobOutlook] = {}
        shares: dict[str, ShareStep] = {}
        for _, batch in self._active:
            if batch["status"] != "in_progress":
                continue
            batch_id, counts = batch["id"], batch["request_counts"]
            before = self._shares.get(batch_id, ShareStep())
            rate = measured_rate(list(self._progress.get(batch_id, ())), min_span, before.changed_at)
            outlook = forecast(counts["total"] - counts["completed"] - counts["failed"], rate, now,
                               float(batch["expires_at"]), rule.margin)
            if not rule.enabled:
                after = ShareStep()
            elif now >= batch["expires_at"]:  # past its window it sends nothing more: no step to take
                after = before
            else:
                after = next_step(before, outlook, now, rule)
            if batch_id in held and after.step != before.step:
                if after.step > before.step:
                    self.metrics.share_raises += 1
                else:
                    self.metrics.share_lowers += 1
                log.info("batch %s: share step %d → %d (%.2f lines/s, predicted finish %s, deadline %d)",
                         batch_id, before.step, after.step, outlook.lines_per_s, outlook.predicted_finish_at,
                         batch["expires_at"])
            shares[batch_id] = after
            outlooks[batch_id] = JobOutlook(outlook, float(batch["expires_at"]), after.step)
        self._shares, self.metrics.outlooks = shares, outlooks
        self._set_floor(lane_floor((s.step for b, s in shares.items() if b in held), rule.window_per_step))

    def _set_floor(self, floor: int) -> None:
        admission = self.gw.traffic.admission
        cls = self.gw.config.batch.class_
        if self._floor_class not in (None, cls):  # a reload moved batch requests to another class
            admission.set_lane_floor(self._floor_class, 0)
        admission.set_lane_floor(cls, floor)
        self._floor_class = cls

    def outlook(self, batch_id: str) -> dict[str, Any]:
        """A batch object's `m3gate` field: its predicted finish (unix seconds), lines per second, whether it is
        at risk of missing its window, its share step (as of the last look; nothing predicted once it is not in
        progress)."""
        found = self.metrics.outlooks.get(batch_id)
        return found.to_json() if found is not None else dict(NO_OUTLOOK)

    def view(self) -> list[dict[str, Any]]:
        """The status page's active jobs: progress, lines per second and the predicted finish against the
        deadline (across all gateways on the store, as of the last tick)."""
        out = []
        for owner, batch in self._active:
            counts = batch["request_counts"]
            rate, finish = finish_estimate(list(self._progress.get(batch["id"], ())), counts["total"])
            out.append({"id": batch["id"], "owner": owner, "status": batch["status"], "endpoint": batch["endpoint"],
                        **counts, "lines_per_s": round(rate, 2), "predicted_finish": finish,
                        "at_risk": self.outlook(batch["id"])["at_risk"],
                        "share_step": self.outlook(batch["id"])["share_step"],
                        "expires_at": batch["expires_at"], "created_at": batch["created_at"]})
        return out

    def _store(self) -> BatchStore:
        assert self.store is not None, "batch runner not started"
        return self.store

    # a job's steps ---------------------------------------------------------------------------------------------
    async def _advance(self, job: Job, now: float) -> None:
        """Dispatches the job's next lines, or starts its next long step (validating, writing the output files) as a
        task of its own, so that the loop goes on renewing leases and feeding other jobs meanwhile."""
        if job.id in self._steps:
            return
        if job.status == "in_progress" and now < job.expires_at:
            await self._dispatch(job)
        elif job.status == "validating":
            self._step(job, self._validate(job))
        elif job.status == "finalizing":
            self._step(job, self._finish(job, "completed"))
        elif not self._busy.get(job.id):  # cancelling, or past its window: once its lines in flight are done
            self._step(job, self._finish(job, "cancelled" if job.status == "cancelling" else "expired"))

    def _step(self, job: Job, step: Coroutine[Any, Any, None]) -> None:
        async def run() -> None:
            try:
                await step
            except Exception:  # the store or the disk failed: the next tick tries the step again
                log.exception("batch %s: %s step failed", job.id, job.status)
            finally:
                self._steps.pop(job.id, None)
                self.wake()
        self._steps[job.id] = asyncio.create_task(run(), name=f"m3gate-batch-{job.status}")

    async def _validate(self, job: Job) -> None:
        """Checks the input file chunk by chunk in a worker thread and stores the valid lines with their prefix
        group; any error fails the batch with up to MAX_LINE_ERRORS of them (OpenAI's `errors` list)."""
        path = await self._input_path(job)
        gw = self.gw
        scan = LineScan(job.obj["endpoint"], gw.served_models, gw.config.server.max_body_bytes)
        if path is None:
            scan.errors.append(LineError(0, "file_not_found", "The input file was deleted."))
        while path is not None and len(scan.errors) < MAX_LINE_ERRORS:
            rows = await asyncio.to_thread(scan.next_chunk, path, _VALIDATE_CHUNK)
            if rows is None:
                break
            if not scan.errors:
                await self._store().add_lines(job.id, rows)
        await self._validated(job, scan.errors, scan.requests)

    async def _validated(self, job: Job, errors: list[LineError], lines: int) -> None:
        store, now = self._store(), int(time.time())
        if not errors and not lines:
            errors = [LineError(0, "empty_file", "The input file has no requests.")]
        if errors:
            data = [e.to_openai() for e in errors[:MAX_LINE_ERRORS]]
            await store.update_batch(job.id, {"status": "failed", "failed_at": now,
                                              "errors": {"object": "list", "data": data}}, only_from=("validating",))
            await store.forget_lines(job.id)
            return
        await store.set_total(job.id, lines)
        await store.update_batch(job.id, {"status": "in_progress", "in_progress_at": now},
                                 only_from=("validating",))

    async def _dispatch(self, job: Job) -> None:
        """Fills this gateway's free slots (batch.max_in_flight) with the job's next lines, a cold prefix group's
        leader first (policies/batch.py `lines_to_send`); a job with nothing left to run moves to finalizing."""
        busy = self._busy.setdefault(job.id, {})
        free = max(0, self.gw.config.batch.max_in_flight - sum(len(b) for b in self._busy.values()))
        rows = await self._store().pending(job.id, free + len(busy) + _LOOK_AHEAD)
        if not rows and not busy:
            self._busy.pop(job.id, None)
            self._warm.pop(job.id, None)
            await self._store().update_batch(job.id, {"status": "finalizing", "finalizing_at": int(time.time())},
                                             only_from=("in_progress",))
            self.wake()
            return
        path = await self._input_path(job)
        waiting = {r.line_no: r for r in rows if r.line_no not in busy}
        chosen = lines_to_send([(r.line_no, r.group) for r in waiting.values()], busy.values(),
                               self._warm.setdefault(job.id, set()), free)
        for line in (waiting[n] for n in chosen):
            busy[line.line_no] = line.group
            task = asyncio.create_task(self._run_line(job, line, path))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_line(self, job: Job, line: PendingLine, path: Path | None) -> None:
        try:
            answer = await self._answer(job, line, path)
            if answer is None:  # no capacity now: the line stays pending
                await asyncio.sleep(RETRY_AFTER_S)
            else:
                self._warm.get(job.id, set()).add(line.group)  # its prefix is cached now
                if await self._store().record_result(job.id, line.line_no, line.custom_id, *answer):
                    self.metrics.requests_done("completed" if answer[0] else "failed")
        except Exception:  # the store failed: the line stays pending and runs again
            log.exception("batch %s line %d failed to run", job.id, line.line_no)
            await asyncio.sleep(RETRY_AFTER_S)
        finally:
            self._busy.get(job.id, {}).pop(line.line_no, None)
            self.wake()

    async def _answer(self, job: Job, line: PendingLine, path: Path | None) -> tuple[bool, bytes] | None:
        """(2xx, the output line) of one line, or None when it was refused for capacity (run it again later)."""
        request_id = f"batch_req_{uuid.uuid4().hex}"
        try:
            if path is None:
                raise FileNotFoundError(job.obj["input_file_id"])
            item = orjson.loads(await asyncio.to_thread(read_at, path, line.pos, line.length))
        except OSError:
            return False, failed_line(request_id, line.custom_id, "input_file_deleted",
                                      "The batch's input file was deleted before this request ran.")
        status, upstream_id, body = await self.call(job.owner, job.obj["endpoint"], item["body"])
        if status in RETRY_STATUSES:
            return None
        return 200 <= status < 300, output_line(request_id, line.custom_id, status, upstream_id, body)

    async def _finish(self, job: Job, final: str) -> None:
        """Writes the output and error files from the stored results (expired: the lines left get
        `batch_expired`), then the final status."""
        store, now = self._store(), int(time.time())
        out_id, err_id, expired = await write_outputs(store, job, self.files_dir, final == "expired")
        self.metrics.requests_done("expired", expired)
        await store.update_batch(job.id, {"status": final, f"{final}_at": now, "output_file_id": out_id,
                                          "error_file_id": err_id, **({"finalizing_at": job.obj.get(
                                              "finalizing_at") or now} if final == "completed" else {})},
                                 only_from=(job.status,), failed_extra=expired)
        await store.forget_lines(job.id)
        self._busy.pop(job.id, None)
        self._warm.pop(job.id, None)

    async def _input_path(self, job: Job) -> Path | None:
        found = await self._store().get_file(job.obj["input_file_id"], None)
        return Path(found[1]) if found else None

    # one line through the gateway's own request path ----------------------------------------------------------
    async def call(self, owner: str, path: str, body: Any) -> tuple[int, str, Any]:
        """(status, request id, body) of one request served in-process as `owner` in the batch class."""
        client = self._client(owner)
        if client is None:
            error = {"message": f"The API key '{owner}' that created this batch no longer exists.",
                     "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
            return 401, "", {"error": error}
        payload = orjson.dumps(body)
        scope = _scope(path, payload, self.gw.config.batch.class_, client)
        response = await self.coordinator.serve(Request(scope, _receive(payload)), APIS[path])
        status, headers, content = await _collect(response, scope)
        try:
            answer = orjson.loads(content)
        except orjson.JSONDecodeError:
            answer = content.decode("utf-8", "replace")
        request_id = headers.get("x-request-id") or (answer.get("id") if isinstance(answer, dict) else None)
        return status, str(request_id or uuid.uuid4().hex), answer

    def _client(self, owner: str) -> Client | None:
        """The job owner's key, allowed the batch class; None when the key is gone. An open gateway: anyone."""
        keys = self.gw.traffic.keys
        if keys.open:
            return ANONYMOUS
        key = keys.by_name(owner)
        if key is None:
            return None
        cls = self.gw.config.batch.class_
        return Client(key.model_copy(update={"allowed_classes": [*key.allowed_classes, cls]}))


def open_store(url: str | None, files_dir: Path) -> BatchStore:
    """The store `batch.store` names (unset: SQLite in the files folder)."""
    if url is None:
        return BatchStore(f"sqlite:///{files_dir / 'batch.sqlite3'}")
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return BatchStore(url)


def _scope(path: str, payload: bytes, cls: str, client: Client) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (CLASS_HEADER.encode(), cls.encode())]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {}, IN_PROCESS_CLIENT: client}


def _receive(payload: bytes) -> Any:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # the "client" never leaves: waits until cancelled
        return {"type": "http.disconnect"}
    return receive


async def _collect(response: Response, scope: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    """Runs the response into memory: one answer's status, headers and body."""
    status, headers, chunks = 0, {}, []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            headers.update((k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await response(scope, _receive(b""), send)
    return status, headers, b"".join(chunks)
