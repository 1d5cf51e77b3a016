"""Operator API under /admin, guarded by its own key (constant-time compare); client keys never open it.

Without `admin.api_key` configured it answers loopback clients only.
"""

from __future__ import annotations

import hmac
import os
import re
import signal
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.runtime import Gateway
from gateway.errors import error_response

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def _authorized(request: Request) -> Response | None:
    gw: Gateway = request.app.state.gateway
    key = gw.config.admin.api_key
    if key is None:
        host = request.client.host if request.client else ""
        if host in LOOPBACK:
            return None
        return error_response(403, "The admin API is open to loopback clients only until admin.api_key is set.",
                              "permission_error", code="admin_forbidden")
    sent = request.headers.get("authorization", "")
    token = sent[7:] if sent[:7].lower() == "bearer " else ""
    if token and hmac.compare_digest(token.encode(), key.get_secret_value().encode()):
        return None
    return error_response(401, "The admin API needs `Authorization: Bearer <admin key>`.", "authentication_error",
                          code="invalid_admin_key")


check_admin = _authorized  # the status page's data (gateway/ui.py) is guarded the same way


def replica_view(gw: Gateway) -> dict[str, Any]:
    now = gw.clock()
    pools: dict[str, Any] = {}
    for name, pool in gw.pools.items():
        replicas = {}
        for snap, replica in zip(pool.snapshots(now, role=None), pool.replicas.values(), strict=True):
            probe = gw.monitor.state_of(replica) if gw.monitor is not None else None
            replicas[replica.url] = {
                "role": replica.role,
                "available": replica.is_available(now),
                "healthy": replica.healthy,
                "draining": replica.drain_state is not None,
                "drain_reason": replica.drain_state,  # "admin", or why the replica itself is shutting down
                "drains": replica.drains,  # times it was seen shutting down, since the gateway started
                "ejected_for_s": round(max(0.0, replica.ejected_until - now), 3),
                "consecutive_failures": replica.consecutive_failures,
                "ejections": replica.ejections,  # since the gateway started (each with its back-off)
                "in_flight": replica.in_flight,
                "in_flight_tokens": replica.in_flight_tokens,
                "requests_total": replica.requests_total,
                "waiting": snap.waiting,
                "running": snap.running,
                "kv_usage": snap.kv_usage,
                "metrics_age_s": None if snap.metrics_age_s is None else round(snap.metrics_age_s, 3),
                "kv_blocks": replica.kv_blocks,
                "prefix_index_blocks": gw.prefix_index.size(replica.url),  # bounded by prefix_index_capacity
                "prefix_index_capacity": gw.prefix_index.capacity(replica.url),
                "prefill_s_per_token": replica.prefill_s_per_token,
                "tpot_s": replica.tpot_s,
                "prefill_step_ends_in_s": round(max(0.0, snap.step_ends_in), 4),  # its virtual step clock
                "queued_prefill_tokens": snap.prefill_tokens,
                "probe_every_s": probe.period_s if probe is not None else None,  # backed off while idle
            }
        model = gw.latency.get(name)
        pools[name] = {"max_model_len": pool.config.max_model_len, "modalities": pool.config.modalities,
                       "policy": gw.config.routing.policy, "replicas": replicas,
                       # the TTFT model: the learnt engine step cost, the P90's coefficients and residual spread
                       "latency_model": model.coefficients() if model is not None else None}
    return pools


async def pools(request: Request) -> Response:
    if (denied := _authorized(request)) is not None:
        return denied
    return JSONResponse({"pools": replica_view(request.app.state.gateway)})


async def _set_draining(request: Request, draining: bool) -> Response:
    if (denied := _authorized(request)) is not None:
        return denied
    gw: Gateway = request.app.state.gateway
    try:
        body = await request.json()
        endpoint = body["endpoint"].rstrip("/")
    except Exception:  # noqa: BLE001 - any malformed body is the caller's to fix
        return error_response(400, 'Send {"endpoint": "<replica url>"}.', param="endpoint", code="invalid_body")
    for pool in gw.pools.values():
        replica = pool.replicas.get(endpoint)
        if replica is not None:
            replica.draining = draining
            if not draining:
                replica.stop_draining()  # an operator's word; a replica still shutting down refuses and drains again
            return JSONResponse({"endpoint": endpoint, "pool": pool.name, "draining": draining,
                                 "in_flight": replica.in_flight})
    return error_response(404, f"No replica {endpoint} in any pool.", "not_found_error", "endpoint", "unknown_endpoint")


async def drain(request: Request) -> Response:
    return await _set_draining(request, True)


async def undrain(request: Request) -> Response:
    return await _set_draining(request, False)


async def reload(request: Request) -> Response:
    if (denied := _authorized(request)) is not None:
        return denied
    status = await request.app.state.reloader.reload("admin API")
    answer = status.as_json()
    supervisor = request.app.state.supervisor_pid
    if status.ok and supervisor is not None:  # a worker: the others reload too (the supervisor forwards SIGHUP)
        try:
            os.kill(supervisor, signal.SIGHUP)
            answer["workers"] = "all: SIGHUP sent to the supervisor, which forwards it to every worker"
        except OSError as exc:
            answer["workers"] = f"this one only: the supervisor (pid {supervisor}) could not be signalled ({exc})"
    return JSONResponse(answer, status_code=200 if status.ok else 422)


async def reload_status(request: Request) -> Response:
    if (denied := _authorized(request)) is not None:
        return denied
    return JSONResponse(request.app.state.reloader.status.as_json())


async def effective_config(request: Request) -> Response:
    """The config in force, secrets shown as ********** (pydantic SecretStr)."""
    if (denied := _authorized(request)) is not None:
        return denied
    gw: Gateway = request.app.state.gateway
    return JSONResponse(_without_url_passwords(gw.config.model_dump(mode="json", by_alias=True)))


_URL_PASSWORD = re.compile(r"(://[^/@\s:]*):[^/@\s]*@")


def _without_url_passwords(value: Any) -> Any:
    """Passwords inside URLs (`state: redis://:secret@host`, an OTLP endpoint's user:password) masked like the
    config's SecretStr fields."""
    if isinstance(value, str):
        return _URL_PASSWORD.sub(r"\1:**********@", value)
    if isinstance(value, dict):
        return {k: _without_url_passwords(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_url_passwords(v) for v in value]
    return value


async def admin_traffic(request: Request) -> Response:
    """Traffic classes and their queues (gateway/admission.py's view)."""
    if (denied := _authorized(request)) is not None:
        return denied
    return JSONResponse(request.app.state.gateway.traffic.view())


async def admin_sessions(request: Request) -> Response:
    """Open and recently ended agent sessions with their last turns' timings; ids hashed, no prompt text."""
    if (denied := _authorized(request)) is not None:
        return denied
    gw: Gateway = request.app.state.gateway
    if gw.sessions is None:
        return error_response(404, "Session tracking is off (sessions.enabled: false).", "not_found_error",
                              code="sessions_disabled")
    try:
        limit = min(1000, max(1, int(request.query_params.get("limit", "100"))))
    except ValueError:
        return error_response(400, "`limit` must be an integer (1-1000).", param="limit", code="invalid_value")
    store = gw.sessions.store
    return JSONResponse({**gw.sessions.view(limit), "open_sessions": len(store),
                         "counters": {"opened": store.counters.sessions, "resolved": store.counters.resolved,
                                      "ended": store.counters.ended}})


async def admin_capacity(request: Request) -> Response:
    """Per pool and role: current and desired replicas, the bottleneck, predicted p95s at both counts, the demand
    (gateway/capacity/signal.py)."""
    if (denied := _authorized(request)) is not None:
        return denied
    return JSONResponse(request.app.state.gateway.capacity.view())


def admin_routes() -> list[Route]:
    return [
        Route("/admin/pools", pools, methods=["GET"]),
        Route("/admin/replicas/drain", drain, methods=["POST"]),
        Route("/admin/replicas/undrain", undrain, methods=["POST"]),
        Route("/admin/reload", reload, methods=["POST"]),
        Route("/admin/reload", reload_status, methods=["GET"]),
        Route("/admin/config", effective_config, methods=["GET"]),
        Route("/admin/traffic", admin_traffic, methods=["GET"]),
        Route("/admin/sessions", admin_sessions, methods=["GET"]),
        Route("/admin/capacity", admin_capacity, methods=["GET"]),
    ]
