"""HTTP endpoints. The generate endpoints (chat, completions, responses, messages) share one handler."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.app import Gateway
from gateway.errors import UpstreamFailure, error_response, rejected_response
from gateway.metrics import metrics_routes
from gateway.relay import RequestRecord
from policies.errors import RequestRejected
from policies.replica_choice import RoutingRequest

log = logging.getLogger("m3gate")

GENERATE_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}


async def receive_body(request: Request, limit: int, deadline: Callable[[], Any]) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit`. Taken at once when the server
    already holds all of it; otherwise read within `deadline()` (a slowloris body gets a 408)."""
    raw = await buffered_body(request, limit)
    if raw is None:
        async with deadline():
            raw = await read_body(request, limit)
    return raw


def _too_large(size: int, limit: int) -> RequestRejected:
    return RequestRejected(
        f"Request body is {size} bytes; this gateway accepts at most {limit} bytes. Send a smaller request (fewer "
        "or smaller images, shorter context).",
        status=413, code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body as it arrives, chunk by chunk (the caller bounds the wait)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestRejected(
                f"Request body exceeds {limit} bytes. Send a smaller request.", status=413, code="request_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def buffered_body(request: Request, limit: int) -> bytes | None:
    """The whole body when the server has already received all of it (the common case: a request that fits one
    read), taken without arming a deadline timer; None when more is still to come. Looks at uvicorn's request cycle
    (`more_body`, kept by both its h11 and httptools protocols): with any other server this returns None and the
    caller takes the general, deadline-bounded path."""
    cycle = getattr(request.receive, "__self__", None)
    if getattr(cycle, "more_body", True) is not False:
        return None
    message = await request.receive()  # the body is there: returns without waiting
    if message["type"] != "http.request" or message.get("more_body"):
        raise ClientDisconnect()
    body: bytes = message.get("body", b"")
    if len(body) > limit:
        raise _too_large(len(body), limit)
    return body


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise RequestRejected("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestRejected(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestRejected(
            f"The request body must be a JSON object, not a JSON {type(body).__name__}.", code="invalid_type"
        )
    # orjson reads 1024 levels of nesting but writes only 255, and the gateway writes bodies back (model alias,
    # stream_options, /tokenize): refuse what it could not forward. Counting brackets is a cheap first filter.
    if raw.count(b"[") + raw.count(b"{") > 255:
        try:
            orjson.dumps(body)
        except orjson.JSONEncodeError:
            raise RequestRejected("The request body is nested too deeply (over 255 levels of arrays/objects).",
                                  code="invalid_json") from None
    return body


def upstream_payload(
    body: dict[str, Any], raw: bytes, api: str, model: str, stream: bool, priority: int | None = None
) -> tuple[bytes, bool]:
    """The body sent to the replica: unchanged bytes unless routing needs a change. Returns (payload, strip_usage).

    Aliases are rewritten to the served model id, and a streamed chat/completion asks for the usage chunk so the
    gateway learns token counts (the client never sees that chunk unless it asked for it). `priority` is the traffic
    class's, for pools whose vLLM schedules by priority (it replaces any the client sent)."""
    changed = False
    if priority is not None and body.get("priority") != priority:
        body["priority"] = priority
        changed = True
    if body.get("model") != model:
        body["model"] = model
        changed = True
    strip_usage = False
    if stream and api in ("chat", "completions"):
        options = body.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
            strip_usage = changed = True
    return (orjson.dumps(body) if changed else raw), strip_usage


def session_key(request: Request, body: dict[str, Any]) -> str | None:
    key = request.headers.get("x-session-id")
    if key:
        return key
    user = body.get("user")
    return user if isinstance(user, str) and user else None


async def generate(request: Request) -> Any:
    """The generate endpoints as a Starlette route (GatewayApp serves them through `generate_endpoints` instead)."""
    return await handle_generate(request.app.state.gateway, request, GENERATE_PATHS[request.scope["path"]])


def generate_endpoints(gw: Gateway) -> dict[str, ASGIApp]:
    """The generate endpoints as plain ASGI apps, served by GatewayApp ahead of Starlette's middleware and router:
    that stack costs ~5% of a request's CPU and adds nothing here, since the handler answers its own errors in
    OpenAI's shape."""

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await handle_generate(gw, request, GENERATE_PATHS[scope["path"]])
        except Exception:  # a gateway bug: logged, answered as the exception handlers would
            log.exception("unexpected error on POST %s", scope["path"])
            response = error_response(500, "The gateway failed on this request; it has been logged.", "server_error")
        await response(scope, receive, send)

    return {path: endpoint for path in GENERATE_PATHS}


async def handle_generate(gw: Gateway, request: Request, api: str) -> Any:
    """Classify → choose a pool → admit → forward; every outcome is a response (errors in OpenAI's shape)."""
    record = RequestRecord(api=api, stream=False, t_arrival=gw.clock())
    record.extra["path"] = request.scope["path"]
    gw.telemetry.start(record, request.headers)
    try:
        client = gw.traffic.authenticate(request)  # no key, no body read, no pool
        raw = await receive_body(request, gw.config.server.max_body_bytes, gw.traffic.body_deadline)
        body = parse_json_object(raw)
        gw.check_model(body)
        gw.traffic.check_input(body, api)
        profile = await gw.classify(body, api, len(raw))
        record.stream = profile.stream
        record.thinking_mode = profile.thinking_mode
        choice, profile = await gw.choose_pool(profile, body, api, request.headers.get("x-m3gate-pool"))
        record.prompt_tokens_est = profile.prompt_tokens
        record.first_pool, record.pool_reason = choice.pool.name, choice.reason
        record.max_tokens = profile.output_budget if profile.budget_explicit else None
        record.t_classified = gw.clock()
        routing = RoutingRequest(
            prompt_tokens=profile.prompt_tokens,
            output_budget=profile.output_budget,
            block_hashes=gw.prefix_blocks(body, api),
            session_key=session_key(request, body),
        )
        record.t_routed = gw.clock()
        admitted = await gw.traffic.admit(request, record, client, profile, choice)  # may wait for a slot
        payload, strip_usage = upstream_payload(body, raw, api, gw.config.model, profile.stream, admitted.priority)
        return await gw.forward(request, record, admitted.choice, profile, routing, payload, strip_usage)
    except RequestRejected as exc:
        record.status, record.error = exc.status, exc.code or exc.type
        await gw.finished(record)
        return rejected_response(exc, gw.traffic.refusal_headers(record, exc))
    except UpstreamFailure as exc:
        record.status, record.error = exc.status, exc.code
        await gw.finished(record)
        headers = {"retry-after": "1"} if exc.status == 503 else None
        return exc.response(headers)
    except BaseException as exc:  # cancelled, or a gateway bug (→ 500): slot, metrics and span must not leak
        record.status = 499 if isinstance(exc, asyncio.CancelledError) else 500
        record.error = record.error or type(exc).__name__
        await gw.finished(record)
        raise


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
        gw.check_model(body)
    except RequestRejected as exc:
        return rejected_response(exc)
    now = gw.clock()
    for pool in reversed(list(gw.pools.values())):
        for replica in pool.replicas.values():
            if not replica.is_available(now):
                continue
            payload = orjson.dumps({**body, "model": gw.config.model})
            headers = {"content-type": "application/json", **gw._probe_headers(replica)}
            try:
                async with gw.session.post(replica.url + "/tokenize", data=payload, headers=headers) as resp:
                    data = await resp.read()
                    return Response(data, resp.status, media_type="application/json",
                                    headers={"x-m3gate-pool": pool.name, "x-m3gate-endpoint": replica.url})
            except Exception:  # noqa: BLE001 - try the next replica
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
    ]
