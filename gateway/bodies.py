"""Reading a request body safely: size-capped (413), time-bounded for slow senders (408), a JSON object or a 400.

Shared by every route that takes a body (the generate endpoints through the coordinator, /tokenize).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from policies.errors import RequestRejected


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
    # stream_options, /tokenize): refuse what it could not forward. The containers are walked (writing the body back
    # to find out costs ~2 ms for 3 MB); counting brackets first spares a small body the walk, but costs more than the
    # walk on a large one (bytes.count reads ~0.7 GB/s: 5 ms for 3 MB, against 0.4 ms for the walk).
    if (len(raw) > _COUNT_BELOW_BYTES or raw.count(b"[") + raw.count(b"{") > MAX_NESTING) and _too_deep(body):
        raise RequestRejected(f"The request body is nested too deeply (over {MAX_NESTING} levels of arrays/objects).",
                              code="invalid_json")
    return body


MAX_NESTING = 254  # the deepest nesting orjson.dumps writes (255 levels raise)
_COUNT_BELOW_BYTES = 16 * 1024


def _too_deep(body: dict[str, Any]) -> bool:
    """Whether arrays/objects nest more than MAX_NESTING levels (the body itself is level 1). Visits containers
    only: strings and numbers, most of a long prompt's bytes, are skipped by a type check."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > MAX_NESTING:
            return True
        for value in node.values() if type(node) is dict else node:
            kind = type(value)
            if kind is dict or kind is list:
                if value:
                    push((value, depth + 1))
                elif depth >= MAX_NESTING:  # an empty container one level too deep
                    return True
    return False


def check_model(body: dict[str, Any], served: frozenset[str]) -> None:
    """A request may omit `model`; one it names must be served here (404 naming what is)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise RequestRejected("`model` must be a string", param="model", code="invalid_type")
    if model not in served:
        raise RequestRejected(
            f"The model `{model}` does not exist. This gateway serves: {', '.join(sorted(served))}.",
            status=404,
            param="model",
            code="model_not_found",
        )
