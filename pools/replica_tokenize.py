"""POST /tokenize on a replica: the one client for it, whoever asks (an exact prompt count for pool choice, the
gateway's /tokenize route, a resumed stream's prompt ids, the precise pools' hashing, the monitor's drain probe).

One call, one default timeout, one reading of the answer: the status and the bytes, or the failure (a refused
connection told apart: nothing listens there, the replica is shutting down or restarting, not failing). The answer
is read as bytes; its ids are parsed only by a caller that needs them as a list (`TokenizeAnswer.tokens`), and
spliced as bytes by one that does not (`TokenizeAnswer.ids`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import orjson

from policies.vllm_wire import connection_refused, refuses_new_requests, tokenize_ids

TOKENIZE_TIMEOUT_S = 10.0  # a 1M-token prompt renders and tokenizes in a few seconds on a replica


@dataclass(frozen=True, slots=True)
class TokenizeAnswer:
    """What a replica answered: its status and body (status 0: it gave none, `error` says why)."""

    status: int
    body: bytes = b""
    error: BaseException | None = None

    @property
    def refused(self) -> bool:
        """The connection was refused: nothing listens there (shutting down, restarting)."""
        return connection_refused(self.error)

    @property
    def shutting_down(self) -> bool:
        """The replica refused it as vLLM does once SIGTERM came, or refused the connection: drain it."""
        return self.refused or refuses_new_requests(self.status, self.body)

    def ids(self) -> bytes | None:
        """The prompt's ids as JSON text (no brackets), or None: no 200, or a malformed answer."""
        return tokenize_ids(self.body) if self.status == 200 else None

    def _json(self) -> dict[str, object] | None:
        if self.status != 200:
            return None
        try:
            obj = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None
        return obj if isinstance(obj, dict) else None

    def count(self) -> int | None:
        data = self._json()
        count = data.get("count") if data is not None else None
        return count if isinstance(count, int) and not isinstance(count, bool) else None

    def tokens(self) -> list[int] | None:
        data = self._json()
        tokens = data.get("tokens") if data is not None else None
        return tokens if isinstance(tokens, list) else None


async def post_tokenize(session: aiohttp.ClientSession, url: str, payload: bytes,
                        headers: Mapping[str, str] | None = None,
                        timeout_s: float = TOKENIZE_TIMEOUT_S) -> TokenizeAnswer:
    """POST `payload` to `url`/tokenize (a replica's base URL) with `headers` (the pool's key)."""
    try:
        async with session.post(url + "/tokenize", data=payload, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                headers={**(headers or {}), "content-type": "application/json"}) as resp:
            return TokenizeAnswer(resp.status, await resp.read())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return TokenizeAnswer(0, error=exc)
