"""OpenAI-shaped errors: every refusal the gateway itself makes looks like `{"error":{message,type,param,code}}`."""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from starlette.responses import Response

from policies.errors import RequestRejected


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
    return Response(error_body(message, type_, param, code), status, headers=headers, media_type="application/json")


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
