"""Prefill/decode disaggregation: vLLM 0.32's NixlConnector (pull mode) between simulated replicas.

What a proxy sees is vLLM's contract (`distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`):

1. To a prefill replica: `kv_transfer_params: {"do_remote_decode": true}` (with max_tokens 1, stream false). It
   prefills, samples one token and, as the request finishes, `request_finished` keeps the request's blocks and
   answers `kv_transfer_params: {do_remote_prefill: true, do_remote_decode: false, remote_block_ids: [[ids]],
   remote_engine_id, remote_request_id, remote_host, remote_port, tp_size, dcp_size, pp_size, remote_num_tokens,
   remote_blocks_expiry_time: null, transfer_mode: "pull", remote_prefill_cached_tokens}` (the last one only when
   the request finished in its first-token step, as the scheduler adds it from the prefill stats).
2. To a decode replica: those params as they came. It allocates the prompt (adopting its own prefix hits), parks
   the request out of the batch, pulls the other blocks, tells the prefill side it read them (which frees them
   there), caches them and decodes; usage reports the prefill side's `remote_prefill_cached_tokens`.

The prefill side holds the blocks for a lease (`kv_lease_duration`, 30 s); the decode side heartbeats every
lease/6 while its request waits, each heartbeat extending the lease to now + 2/3 of it. An expired lease frees the
blocks (logged, `vllm:nixl_num_kv_expired_reqs`); a decode side that reads them later still decodes (NIXL reads
whatever the memory holds) and the prefill side logs the late notification (`vllm:nixl_num_notifications_after_
expiry`). A failed handshake (prefill replica gone, or restarted with a new engine id) fails the request with
finish_reason "error" (a 500) under vLLM's default `kv_load_failure_policy` "fail", or recomputes the prompt
locally under "recompute".

Transport (the simulator's own): NIXL's ZMQ side channel, RDMA read and notification become HTTP calls from the
decode replica to the prefill replica's `/sim/kv/*` routes, addressed by `remote_host`/`remote_port` (the prefill
replica's HTTP address, where vLLM gives its side-channel address). The read itself is a sleep of
`--kv-transfer-ms-per-block` per pulled block on the decode side: the prefill replica's engine is not involved.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pools.sim.engine import Engine, SimRequest
from pools.sim.settings import SimSettings

if TYPE_CHECKING:
    from pools.sim.metrics import SimMetrics

log = logging.getLogger("pools.sim.disagg")
JSON = "application/json"
REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass
class Held:
    """Blocks of a finished prefill-side request, kept until read or expired (vLLM's _reqs_to_send entry)."""

    blocks: list[int]
    deadline: float  # time.monotonic()


@dataclass
class TransferCounters:
    held: int = 0  # prefill side: requests whose blocks were kept for a decode side
    released_after_read: int = 0
    expired: int = 0
    notifications_after_expiry: int = 0
    heartbeats_received: int = 0
    pulls: int = 0  # decode side: successful pulls
    pulled_blocks: int = 0
    failed_pulls: int = 0
    failed_notifications: int = 0


class NixlConnector:
    """Both sides of the connector for one replica; the engine calls `start_load` and `request_finished`."""

    def __init__(self, settings: SimSettings, engine: Engine, metrics: SimMetrics) -> None:
        self.settings = settings
        self.config = settings.kv_transfer
        self.engine = engine
        assert metrics.nixl is not None, "SimMetrics(kv_connector=True) registers the NIXL metrics"
        self.nixl = metrics.nixl
        self.engine_id = self.config.engine_id or str(uuid.uuid4())
        host = settings.host
        self.host = "localhost" if host in ("0.0.0.0", "::", "") else host
        # as vLLM, the address handed to decode replicas may be set apart from the listen address (containers)
        self.host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or self.host
        self.port = settings.port  # the server sets the bound port (`--port 0`)
        self.held: dict[str, Held] = {}
        self.counters = TransferCounters()
        self._heartbeats: dict[tuple[str, str], set[str]] = defaultdict(set)  # (base url, engine) -> remote req ids
        self._heartbeat_of: dict[int, tuple[tuple[str, str], str]] = {}  # id(SimRequest) -> its heartbeat entry
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._session: aiohttp.ClientSession | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        return [Route("/sim/kv/handshake", self.handshake_route, methods=["GET"]),
                Route("/sim/kv/read", self.read_route, methods=["POST"]),
                Route("/sim/kv/heartbeat", self.heartbeat_route, methods=["POST"])]

    async def stop(self) -> None:
        for task in [*self._tasks, *([self._heartbeat_task] if self._heartbeat_task else [])]:
            task.cancel()
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("KV transfer task failed", exc_info=task.exception())

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        return self._session

    # ---- the frontend: a request's kv_transfer_params -------------------------------------------------------

    def configure(self, sim: SimRequest, params: dict[str, Any] | None) -> None:
        """Attach a request's kv_transfer_params (a private copy: the engine mutates it, as vLLM's does).
        Decode-side params with all remote fields make the engine pull; incomplete ones are logged and the prompt
        is computed locally (vLLM 0.32 would park such a request for good)."""
        if not params:
            return
        sim.kv_transfer = dict(params)
        if not params.get("do_remote_prefill"):
            return
        cached = params.get("remote_prefill_cached_tokens")
        if isinstance(cached, int) and not isinstance(cached, bool):
            sim.reported_cached_tokens = cached
        if params.get("remote_block_ids") and all(k in params for k in REMOTE_FIELDS):
            sim.remote_prefill = True
            if params.get("tp_size") is not None:
                key = (_base_url(params), str(params["remote_engine_id"]))
                self._heartbeats[key].add(str(params["remote_request_id"]))
                self._heartbeat_of[id(sim)] = (key, str(params["remote_request_id"]))
                self._ensure_heartbeats()
        else:
            log.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params)

    def rejected(self, params: dict[str, Any] | None) -> None:
        """A decode-side request refused before reaching the engine (vLLM's notify_kv_transfer_request_rejected):
        the prefill side is told to free its blocks."""
        if params and params.get("do_remote_prefill") and all(k in params for k in REMOTE_FIELDS):
            self._spawn(self._notify(_base_url(params), str(params["remote_request_id"])))

    # ---- engine hooks ------------------------------------------------------------------------------------------

    def start_load(self, req: SimRequest, num_blocks: int) -> None:
        self._spawn(self._pull(req, num_blocks))

    def request_finished(self, req: SimRequest, reason: str, now: float) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's NixlPullConnectorScheduler.request_finished."""
        params = req.kv_transfer
        if not params:
            return False, None
        self._stop_heartbeat(req)
        if req.remote_prefill:  # decode side, finished before its pull began: free the prefill side's blocks
            req.remote_prefill = False
            self.rejected(params)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None  # decode side: nothing to hand on
        if reason not in ("stop", "length"):
            return False, None  # aborted or failed: free at once, nothing to read
        hold = bool(req.blocks)
        remote_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"  # vLLM's internal request id
        if hold:
            self.held[remote_id] = Held(list(req.blocks), time.monotonic() + self.config.lease_duration_s)
            self.counters.held += 1
            asyncio.get_running_loop().call_later(self.config.lease_duration_s, self._expire, remote_id)
        out: dict[str, Any] = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(req.blocks)],
            "remote_engine_id": self.engine_id, "remote_request_id": remote_id, "remote_host": self.host,
            "remote_port": self.port, "tp_size": self.config.tp_size, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": req.num_computed if hold else 0, "remote_blocks_expiry_time": None,
            "transfer_mode": "pull"}
        if req.first_token_at == now:  # the scheduler adds it while the request's prefill stats are at hand
            out["remote_prefill_cached_tokens"] = req.cached_tokens
        return hold, out

    # ---- prefill side ------------------------------------------------------------------------------------------

    def _release(self, remote_id: str) -> bool:
        held = self.held.pop(remote_id, None)
        if held is None:
            return False
        self.engine.release_blocks(held.blocks)
        return True

    def _expire(self, remote_id: str) -> None:
        held = self.held.get(remote_id)
        if held is None:
            return
        left = held.deadline - time.monotonic()
        if left > 0:  # a heartbeat extended the lease
            asyncio.get_running_loop().call_later(left, self._expire, remote_id)
            return
        self._release(remote_id)
        self.counters.expired += 1
        self.nixl.kv_expired_reqs.inc()
        log.warning("Releasing expired KV blocks for request %s which were retrieved by 0 remote worker(s) before "
                    "lease expired.", remote_id)

    async def handshake_route(self, request: Request) -> Response:
        return _json({"engine_id": self.engine_id, "block_size": self.settings.block_size,
                      "tp_size": self.config.tp_size, "transfer_mode": "pull"})

    async def read_route(self, request: Request) -> Response:
        """The decode side's notification that it has read (or no longer needs) a request's blocks."""
        body = orjson.loads(await request.body())
        remote_id = str(body.get("request_id"))
        released = self._release(remote_id)
        if released:
            self.counters.released_after_read += 1
        else:
            self.counters.notifications_after_expiry += 1
            self.nixl.notifications_after_expiry.inc()
            log.error("Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode worker. "
                      "They may have expired.", remote_id)
        return _json({"released": released})

    async def heartbeat_route(self, request: Request) -> Response:
        """Extends each named request's lease to now + 2/3 of the lease (never shortens it)."""
        body = orjson.loads(await request.body())
        self.counters.heartbeats_received += 1
        new_deadline = time.monotonic() + self.config.lease_duration_s * 2 / 3
        for remote_id in body.get("request_ids") or ():
            held = self.held.get(str(remote_id))
            if held is not None:
                held.deadline = max(held.deadline, new_deadline)
        return _json({})

    # ---- decode side -------------------------------------------------------------------------------------------

    async def _pull(self, req: SimRequest, num_blocks: int) -> None:
        ok = False
        try:
            ok = await self._read(req, num_blocks)
        finally:  # whatever happens, the request leaves "loading"
            self._stop_heartbeat(req)
            self.engine.finish_load(req, ok)

    async def _read(self, req: SimRequest, num_blocks: int) -> bool:
        """Handshake (checks the engine id), the read's modelled time, then the notification. False when the
        handshake failed."""
        params = req.kv_transfer or {}
        base = _base_url(params)
        remote_id = str(params.get("remote_request_id"))
        try:
            async with self._client().get(f"{base}/sim/kv/handshake") as resp:
                meta = await resp.json(content_type=None)
            expected = params.get("remote_engine_id")
            if meta.get("engine_id") != expected:
                raise RuntimeError(f"Remote NIXL agent engine ID mismatch. Expected {expected},received "
                                   f"{meta.get('engine_id')}.")
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
            self.counters.failed_pulls += 1
            self.nixl.failed_transfers.inc()
            log.error("NIXL transfer failure: handshake_failed | Context: %s", {
                "failure_type": "handshake_failed", "request_id": req.request_id, "engine_id": self.engine_id,
                "remote_engine_id": params.get("remote_engine_id"), "remote_request_id": remote_id,
                "remote_host": params.get("remote_host"), "remote_port": params.get("remote_port"),
                "error": repr(exc)})
            return False
        cost = self.settings.cost
        seconds = 0.0 if cost.instant else num_blocks * self.config.ms_per_block / 1000 / cost.speed
        if seconds > 0:
            await asyncio.sleep(seconds)
        self.nixl.xfer_time.observe(seconds)
        self.counters.pulls += 1
        self.counters.pulled_blocks += num_blocks
        await self._notify(base, remote_id)
        return True

    async def _notify(self, base: str, remote_id: str) -> None:
        """Tell the prefill side a request's blocks were read; a lost notification does not fail the request
        (the KV is already here), as in vLLM."""
        try:
            async with self._client().post(f"{base}/sim/kv/read", json={"request_id": remote_id}) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            self.counters.failed_notifications += 1
            self.nixl.failed_notifications.inc()
            self.nixl.failed_transfers.inc()

    def _stop_heartbeat(self, req: SimRequest) -> None:
        entry = self._heartbeat_of.pop(id(req), None)
        if entry is None:
            return
        key, remote_id = entry
        ids = self._heartbeats.get(key)
        if ids is not None:
            ids.discard(remote_id)
            if not ids:
                del self._heartbeats[key]

    def _ensure_heartbeats(self) -> None:
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def _heartbeat_loop(self) -> None:
        """vLLM sends "HB:id1,id2" to each prefill engine every kv_lease_duration // 6 while requests wait."""
        interval = max(0.01, self.config.lease_duration_s / 6)
        while self._heartbeats:
            await asyncio.sleep(interval)
            for (base, _engine), ids in list(self._heartbeats.items()):
                if ids:
                    self._spawn(self._send_heartbeat(base, sorted(ids)))

    async def _send_heartbeat(self, base: str, ids: list[str]) -> None:
        try:
            async with self._client().post(f"{base}/sim/kv/heartbeat", json={"request_ids": ids}) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            log.warning("Failed to send heartbeat to %s", base)

    # ---- views ----------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"role": self.config.role, "engine_id": self.engine_id, "held_requests": len(self.held),
                "held_blocks": sum(len(h.blocks) for h in self.held.values()), "held_total": c.held,
                "released_after_read": c.released_after_read, "expired": c.expired,
                "notifications_after_expiry": c.notifications_after_expiry,
                "heartbeats_received": c.heartbeats_received, "loading": len(self.engine.loading), "pulls": c.pulls,
                "pulled_blocks": c.pulled_blocks, "failed_pulls": c.failed_pulls,
                "failed_notifications": c.failed_notifications}


def _base_url(params: dict[str, Any]) -> str:
    host = str(params.get("remote_host"))
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{params.get('remote_port')}"


def _json(obj: Any) -> Response:
    return Response(orjson.dumps(obj), media_type=JSON)
