"""The client-facing HTTP endpoints. The generate endpoints (chat, completions, responses, messages) are the
coordinator's (`Coordinator.serve`); the rest are small: models, /tokenize, health, readiness, metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.bodies import check_model, parse_json_object, receive_body
from gateway.coordinator import Coordinator
from gateway.observability.engine_spans import engine_span_routes
from gateway.errors import error_response, rejected_response
from gateway.observability.metrics import metrics_routes
from gateway.runtime import Gateway
from policies.errors import RequestRejected
from pools.replica_tokenize import post_tokenize

log = logging.getLogger("m3gate")

GENERATE_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}


async def generate(request: Request) -> Any:
    """The generate endpoints as a Starlette route (GatewayApp serves them through `generate_endpoints` instead)."""
    coordinator: Coordinator = request.app.state.coordinator
    return await coordinator.serve(request, GENERATE_PATHS[request.scope["path"]])


def generate_endpoints(coordinator: Coordinator) -> dict[str, ASGIApp]:
    """The generate endpoints as plain ASGI apps, served by GatewayApp ahead of Starlette's middleware and router:
    that stack costs ~5% of a request's CPU and adds nothing here, since the handler answers its own errors in
    OpenAI's shape."""

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await coordinator.serve(request, GENERATE_PATHS[scope["path"]])
        except Exception:  # a gateway bug: logged, answered as the exception handlers would
            log.exception("unexpected error on POST %s", scope["path"])
            response = error_response(500, "The gateway failed on this request; it has been logged.", "server_error",
                                      code="internal_error")
        await response(scope, receive, send)

    return {path: endpoint for path in GENERATE_PATHS}


async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        gw.traffic.authenticate(request)
    except RequestRejected as exc:
        return rejected_response(exc)
    now = gw.clock()
    live = [p.config.max_model_len for p in gw.pools.values() if p.available(now)]
    max_len = max(live or [p.config.max_model_len for p in gw.pools.values()])
    created = int(time.time())
    cards = [
        {"id": model_id, "object": "model", "created": created, "owned_by": "m3gate", "root": gw.config.model,
         "parent": None, "max_model_len": max_len}
        for model_id in gw.config.served_model_ids()
    ]
    return JSONResponse({"object": "list", "data": cards})


async def tokenize(request: Request) -> Any:
    """Relayed to the largest available pool, whose `max_model_len` is what the gateway can serve."""
    gw: Gateway = request.app.state.gateway
    assert gw.session is not None
    try:
        gw.traffic.authenticate(request)  # /tokenize reaches a replica: same keys as generation
        raw = await receive_body(request, gw.config.server.max_body_bytes, gw.traffic.body_deadline)
        body = parse_json_object(raw)
        check_model(body, gw.served_models)
    except RequestRejected as exc:
        return rejected_response(exc)
    now = gw.clock()
    for pool in reversed(list(gw.pools.values())):
        for replica in pool.replicas.values():
            if not replica.is_available(now):
                continue
            answer = await post_tokenize(gw.session, replica.url, orjson.dumps({**body, "model": gw.config.model}),
                                         pool.probe_headers())
            if answer.status:
                return Response(answer.body, answer.status, media_type="application/json",
                                headers={"x-m3gate-pool": pool.name, "x-m3gate-endpoint": replica.url})
            if answer.refused:  # nothing listens: shutting down or restarting, not a failure to eject
                replica.start_draining("connection refused")
            else:  # try the next replica
                replica.record_failure(gw.clock())
    return error_response(503, "No healthy replica can tokenize right now; retry shortly.", "upstream_error",
                          code="no_healthy_replica", headers={"retry-after": "1"})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    now = gw.clock()
    pools = {name: pool.available(now) for name, pool in gw.pools.items()}
    status = 200 if any(pools.values()) else 503
    return JSONResponse({"ready": status == 200, "pools": pools}, status_code=status)


def routes() -> list[Route]:
    handler: Callable[[Request], Coroutine[Any, Any, Any]] = generate
    return [
        *(Route(path, handler, methods=["POST"]) for path in GENERATE_PATHS),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        *metrics_routes(),
        *engine_span_routes(),  # POST /v1/traces: the replicas' own spans (off unless configured)
    ]
