"""The one exception policies raise when a request cannot be served as sent.

Policies do no I/O, so they cannot answer HTTP themselves; they raise `RequestRejected` and the gateway turns it into
OpenAI's error body `{"error": {"message", "type", "param", "code"}}` with `status` as the HTTP status. The message
must tell the caller what to change, because it is all they will see.
"""

from __future__ import annotations

from typing import Any


class RequestRejected(Exception):
    """A request the gateway refuses before any replica sees it (a 4xx, never a retry)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",  # noqa: A002 - the OpenAI field is called `type`
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's error body, as the gateway returns it."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return (f"RequestRejected(status={self.status}, code={self.code!r}, param={self.param!r}, "
                f"message={self.message!r})")
