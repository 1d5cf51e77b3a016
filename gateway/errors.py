"""OpenAI-shaped errors: every refusal the gateway itself makes looks like `{"error":{message,type,param,code}}`, and
carries its `code` again in the `x-m3gate-refusal` header, so a client or an upstream dispatcher can back off by
reason without parsing the body."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from starlette.responses import Response

from policies.errors import RequestRejected


REFUSAL_HEADER = "x-m3gate-refusal"  # the error body's `code`, on every refusal that has one
QUEUE_MS_HEADER = "x-m3gate-queue-ms"  # milliseconds the request waited in the gateway's admission queue


def queue_ms(seconds: float) -> str:
    """`x-m3gate-queue-ms`'s value: milliseconds with one decimal, "0" for a request that did not wait."""
    return f"{seconds * 1000.0:.1f}" if seconds > 0 else "0"


def refusal_headers(code: str | int | None, headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """`headers` plus `x-m3gate-refusal: <code>` (the one place it is set; no header for a body whose code is null)."""
    out = dict(headers) if headers else {}
    if code is not None:
        out[REFUSAL_HEADER] = str(code)
    return out


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    return Response(error_body(message, type_, param, code), status, headers=refusal_headers(code, headers),
                    media_type="application/json")


def rejected_response(exc: RequestRejected, headers: Mapping[str, str] | None = None) -> Response:
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, headers)


class UpstreamFailure(Exception):
    """No replica could give a response (connection errors, timeouts, 5xx) even after the retry."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    def response(self, headers: Mapping[str, str] | None = None) -> Response:
        type_ = "timeout_error" if self.status == 504 else "upstream_error"
        return error_response(self.status, self.message, type_, None, self.code, headers)
