"""The door: who may send requests (client API keys) and what may come through it (header size, a body that
arrives in time).

Keys are configured as sha256 hashes only, so a leaked config file leaks no key. A presented key is hashed and
compared with every configured hash in constant time (hmac.compare_digest, no early exit), so response timing says
nothing about which bytes matched. Keys come from `Authorization: Bearer` (OpenAI SDKs) or `x-api-key` (Anthropic
SDKs). Without any key configured the gateway is open, and says so loudly when it starts.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from policies.errors import RequestRejected
from policies.config import ApiKeyConfig

OPEN_GATEWAY_WARNING = (
    "\n" + "!" * 100 + "\n"
    "!!  NO CLIENT API KEYS CONFIGURED: this gateway serves anyone who can reach it, without rate limits.\n"
    "!!  Add access.keys (or access.keys_file) to require keys; see docs/operations.md.\n" + "!" * 100
)


@dataclass(frozen=True, slots=True)
class Client:
    """Who sent a request: its key's config, or None when the gateway is open."""

    key: ApiKeyConfig | None

    @property
    def name(self) -> str:
        return self.key.name if self.key else "anonymous"

    @property
    def key_id(self) -> str:
        """A stable, non-secret id (a prefix of the key's hash): Redis counters and fairness use it."""
        return self.key.key_sha256[:16] if self.key else ""


ANONYMOUS = Client(None)
# An ASGI scope key the gateway itself sets on requests it makes in-process (the Batch API's runner): the Client they
# run as. A scope is built by the server, so no request from the network can carry it.
IN_PROCESS_CLIENT = "m3gate.client"


class KeyStore:
    """The configured client keys, by hash."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Sequence[ApiKeyConfig]) -> None:
        self._keys = [(bytes.fromhex(k.key_sha256), k) for k in keys]

    @property
    def open(self) -> bool:
        return not self._keys

    def by_name(self, name: str) -> ApiKeyConfig | None:
        return next((key for _, key in self._keys if key.name == name), None)

    def lookup(self, presented: str) -> ApiKeyConfig | None:
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found = None
        for stored, key in self._keys:  # every comparison runs: no early exit
            if hmac.compare_digest(stored, digest):
                found = key
        return found

    def authenticate(self, headers: Mapping[str, str]) -> Client:
        """The client behind these headers, or a 401 in OpenAI's shape."""
        if self.open:
            return ANONYMOUS
        presented = presented_key(headers)
        if not presented:
            raise RequestRejected(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>` (OpenAI SDKs) or "
                "`x-api-key: <key>` (Anthropic SDKs); ask the operator of this gateway for one.",
                status=401, code="invalid_api_key",
            )
        key = self.lookup(presented)
        if key is None:
            raise RequestRejected(
                f"Incorrect API key provided: {_masked(presented)}. Check the key you send, or ask the operator of "
                "this gateway for a valid one.",
                status=401, code="invalid_api_key",
            )
        return Client(key)


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key", "").strip() or None


def _masked(key: str) -> str:
    """As OpenAI shows a wrong key: enough to recognise it, not enough to use it."""
    return f"{key[:3]}...{key[-4:]}" if len(key) >= 12 else "***"


def check_header_size(raw_headers: Iterable[tuple[bytes, bytes]], limit: int) -> None:
    """431 when the request's headers together exceed `limit` bytes."""
    size = 0
    for k, v in raw_headers:  # a loop, not sum() over a generator: this runs on every request
        size += len(k) + len(v) + 4  # ": " and CRLF, as on the wire
    if size > limit:
        raise RequestRejected(
            f"The request headers total {size:,} bytes; this gateway accepts at most {limit:,}. Send fewer or "
            "shorter headers (large cookies or tokens are the usual cause).",
            status=431, code="request_headers_too_large",
        )


@asynccontextmanager
async def body_deadline(seconds: float) -> AsyncIterator[None]:
    """The body must have arrived within `seconds`: a client that trickles it (slowloris) gets a 408 instead of
    holding a connection and a task forever."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise RequestRejected(
            f"The request body did not arrive within {seconds:g} s. Send the whole body promptly (check the "
            "Content-Length you declare).",
            status=408, code="request_timeout",
        ) from None
