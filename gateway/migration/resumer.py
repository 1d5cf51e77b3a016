"""`Resumer`: resumes one broken stream on other replicas (the package's docstring says where it fits)."""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from starlette.types import Send

from gateway.migration.id_filter import RECENT_CHUNKS, IdFilter
from gateway.migration.stall import StallWatch
from gateway.record import RequestRecord
from gateway.relay import Held, SseFilter, stream_error_event
from gateway.runtime import Gateway
from policies.m3_stream import M3StreamParser, ParserState
from policies.migration import Mark, chat_cut, chat_finish_reason, nothing_left, resume_payload
from policies.vllm_wire import (
    STREAM_DONE,
    chat_chunk,
    completion_chunk,
    event_json,
    sse_event,
    stream_usage,
    tokenize_body,
    usage_chunk,
)
from pools.replica_tokenize import post_tokenize
from pools.replicas import PoolRuntime, Replica

FINGERPRINT_WAIT_S = 0.5  # after a continuation's finish chunk, how long its usage chunk is waited for
PAUSE_KEEPALIVE = b": paused\n\n"  # an SSE comment: written to a paused stream's client now and then


@dataclass(slots=True)
class Leg:
    """One continuation on one replica: its open stream, its first bytes, and how its events are read."""

    replica: Replica
    held: Held
    data: bytes
    kind: str  # "completions": token-id continuation; "chat": the original request again (nothing committed)


class _Again:
    """A chat continuation that sends the original request again (no id committed): it replays, greedy, what the
    client saw; that part is suppressed, and its chunks are kept for the next cut as the first leg's are."""

    __slots__ = ("suppress_reasoning", "suppress_content", "announced", "ids", "marks", "evicted")

    def __init__(self, state: ParserState) -> None:
        self.suppress_reasoning, self.suppress_content = state.suppress_reasoning, state.suppress_content
        self.announced = state.announced
        self.ids = array("I")
        self.marks: deque[Mark] = deque(maxlen=RECENT_CHUNKS)
        self.evicted = False

    @property
    def replayed(self) -> bool:
        """Everything the client saw has come again: from here on this leg's chunks are the client's record."""
        return not (self.suppress_reasoning or self.suppress_content or self.announced)

    def shown(self, delta: dict[str, Any], before: int) -> dict[str, Any]:
        """Keeps the chunk for a cut; returns its delta less what the client already saw."""
        if len(self.marks) == RECENT_CHUNKS:
            self.evicted = True
        self.marks.append(Mark(before, len(self.ids), dict(delta)))
        for kind in ("reasoning", "content"):
            text, skip = delta.get(kind), getattr(self, "suppress_" + kind)
            if isinstance(text, str) and skip:
                delta[kind] = text[min(skip, len(text)):]
                setattr(self, "suppress_" + kind, skip - min(skip, len(text)))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if function.get("name") and self.announced:
                self.announced -= 1
                call.pop("id", None), call.pop("type", None), function.pop("name", None)
        return delta


@dataclass
class Resumer:
    """What resuming one stream needs; `run` is called by its relay on a failure after the first byte.

    What the client has seen is kept exact after every leg, whether it ended or failed: `generated[:done]` are the
    ids whose effect the client has (the next continuation's context), `state` the M3 parser's state there (with
    the text already shown that a regenerated part must not show again), `finish` set once the client has the
    finish chunk."""

    gw: Gateway
    record: RequestRecord
    body: dict[str, Any]
    api: str
    payload: bytes  # the request as first sent (a chat stream with nothing committed is sent again as it was)
    include_usage: bool  # the client asked for the usage chunk
    choose: Callable[[set[str]], list[Any]]  # the coordinator's targets for this request, these replicas excluded
    # sends one continuation through `Upstream.resume` (target, path, payload, tokens): (Held, first bytes) or a failure
    send_leg: Callable[[Any, str, bytes, int], Awaitable[Any]]
    stall_timeout_s: float
    max_migrations: int
    watch: StallWatch
    generated: array = field(default_factory=lambda: array("I"))
    done: int = 0
    state: ParserState = field(default_factory=ParserState)
    tools_called: bool = False
    prompt_ids: bytes | None = None  # the prompt's ids as JSON text (from /tokenize, spliced, never parsed)
    prompt_tokens: int = 0
    head: dict[str, Any] = field(default_factory=dict)  # the stream's id, created, model
    finish: str | None = None
    first: Held | None = None  # the first leg's (released when it fails: its replica no longer works for us)
    aborted: bool = False  # the current leg's replica ended it with finish_reason "abort"
    refused: str | None = None  # why this stream cannot be resumed (policies.migration.refusal), if it cannot
    pauses: int = 0  # times the background lane paused it (gateway/admission.py)
    pausing: bool = False  # its current leg is being ended by a pause, not a failure
    current: tuple[Held, SseFilter] | None = None  # the leg being relayed, and the filter the relay reads it through
    fingerprint: str | None = None  # the replicas' system_fingerprint, from a continuation's usage chunk

    def parts(self, held: Held, replica: Replica, strip_usage: bool) -> tuple[SseFilter | None, Any]:
        """The first leg's filter and the relay's resume hook: the id-keeping filter, watched for stalls, when the
        stream can be resumed; else the plain filter and a hook that counts it refused and ends it."""
        if self.refused is not None:
            return None, self._refuse
        filt = IdFilter(strip_usage, chat=self.api == "chat")
        self.first = held
        self.watch.add(filt, held, replica, self.stall_timeout_s)
        self.current = (held, filt)
        ticket = self.record.admission_ticket
        if ticket is not None:
            self.gw.traffic.admission.pausable(ticket, self)
        return filt, self.run

    @property
    def replica(self) -> str | None:
        """The replica its current leg runs on (the lane pauses the streams of a full replica)."""
        return self.record.replica

    def pause(self) -> bool:
        """The background lane makes room: end the current leg's upstream request (vLLM aborts it, its batch slot
        and KV blocks free up); the relay reads that as a cut and `run` holds the client until the lane lets it go
        on. False when there is nothing to pause (between legs, already pausing, finished)."""
        current = self.current
        if current is None or self.pausing or self.finish is not None:
            return False
        held, filt = current
        if held.response is None:
            return False
        self.pausing, self.pauses = True, self.pauses + 1
        filt.failure = filt.failure or "pause"
        held.response.close()
        return True

    async def _refuse(self, send: Send, filt: SseFilter, failure: str) -> None:
        self.gw.telemetry.migration(self.record, "refused", 0, "")
        self.record.error = f"upstream failed mid-stream: {self.reason_text(failure)}; not resumable ({self.refused})"
        tail = filt.remainder() + stream_error_event(self.api, "the replica failed mid-stream; retry the request")
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def reason_text(self, failure: str) -> str:
        return {"abort": "the replica aborted the stream", "error": "the replica sent an error mid-stream",
                "stall": "the replica went silent",
                "pause": "paused for foreground work, then no replica took it"}.get(failure, failure)

    # the cut ------------------------------------------------------------------------------------------------------
    def start_from(self, filt: IdFilter) -> None:
        """The first leg's ids, head and cut: chat resumes at `chat_cut`, completions after every id relayed."""
        self.generated = filt.ids
        self.prompt_tokens = filt.prompt_tokens
        head = event_json(filt.head) or {}
        self.head = {k: head[k] for k in ("id", "created", "model") if k in head}
        if self.api == "chat":
            recent = filt.recent_events()
            self._cut(filt.marks(), not filt.evicted)
            self.tools_called = self.tools_called or any(b'"tool_calls"' in e for _, _, e in recent)
        else:
            self.done = len(filt.ids)

    def _cut(self, marks: list[Mark], complete: bool) -> None:
        cut = chat_cut(marks, self.thinking_mode, self.greedy, complete)
        self.done, self.state = cut.done, cut.state
        self.tools_called = self.tools_called or cut.state.tools_called

    @property
    def thinking_mode(self) -> Any:
        kwargs = self.body.get("chat_template_kwargs")
        return kwargs.get("thinking_mode") if isinstance(kwargs, dict) else None

    @property
    def greedy(self) -> bool:
        return self.body.get("temperature") == 0

    # the migration loop -------------------------------------------------------------------------------------------
    async def run(self, send: Send, filt: IdFilter, failure: str) -> None:
        """The stream's replica failed after the first byte (`failure` says how): resume it elsewhere, up to
        max_migrations times, or end it with the SSE error event. Writes the stream's end either way. An answer
        whose finish chunk the client has is complete: only what is missing of its end is written."""
        record = self.record
        self.current = None
        if self.first is not None:
            self.first.close(abort=True)  # the failed replica's in-flight count ends with its leg
        self.start_from(filt)
        if filt.finished:
            self.pausing = False
            record.error = None
            await self._write(send, self._ending(usage=None if self.include_usage and filt.usage is None
                                                 else filt.usage or {}), end=True)
            return
        record.t_cut = record.t_cut or self.gw.clock()
        if await self._legs(send, set() if self.pausing else {record.replica}):
            record.error = None
            return
        self.gw.telemetry.migration(record, "failed", self.done, "")
        record.error = f"upstream failed mid-stream: {self.reason_text(failure)}; not resumed"
        await self._write(send, stream_error_event(
            self.api, "the replica failed mid-stream and no other replica could resume it; retry the request"),
            end=True)

    async def _legs(self, send: Send, failed: set[str]) -> bool:
        """Continuations until the answer ends (True), or no replica can take it, or max_migrations failures
        (False). A paused leg is no failure: the stream waits for the lane, then goes on, on its replica first."""
        migrations = 0
        while True:
            paused = self.pausing
            if paused:
                await self._wait_for_lane(send)
            elif migrations == self.max_migrations:
                return False
            else:
                migrations += 1
            if nothing_left(self.body, self.api, self.done):  # died after its last token: the end is ours to write
                self.gw.telemetry.migration(self.record, "resumed", self.done, "")
                del self.generated[self.done:]
                await self._write(send, self._final_chunk() + self._ending(), end=True)
                return True
            leg = await self._open(failed, self.record.replica if paused and self._room_on_own() else None)
            if leg is None:
                return False
            if not paused:
                self.gw.telemetry.migration(self.record, "resumed", self.done, leg.replica.url)
            try:
                if await self._relay(leg, send):
                    return True
            finally:
                leg.held.close(abort=True)
            if not self.pausing:
                failed.add(leg.replica.url)

    async def _wait_for_lane(self, send: Send) -> None:
        """Paused: its admission slot goes back, and until the lane has room again the client gets only an SSE
        comment every `pause_keepalive_s` of its class (SSE clients skip comments; idle timeouts see bytes)."""
        ticket = self.record.admission_ticket
        if ticket is not None:
            self.gw.telemetry.pause(ticket.pool, ticket.cls)
            cfg = self.gw.config.traffic.classes.get(ticket.cls)
            every = cfg.pause_keepalive_s if cfg is not None else 0.0
            waiting = asyncio.ensure_future(self.gw.traffic.admission.paused(ticket))
            try:
                while not (await asyncio.wait((waiting,), timeout=every or None))[0]:
                    await self._write(send, PAUSE_KEEPALIVE)
                waiting.result()
            finally:
                if not waiting.done():  # the client left while paused (a write failed, or this task was cancelled)
                    waiting.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await waiting
        self.pausing = False

    def _room_on_own(self) -> bool:
        """The replica a paused stream ran on has a batch slot free (or its limit is not known): it goes back there,
        where its prefix is likely cached; else where routing sends it, rather than into a full replica's queue
        ahead of the foreground requests that come next."""
        pool = self.gw.pools.get(self.record.pool)
        replica = pool.replicas.get(self.record.replica) if pool is not None else None
        return replica is None or replica.has_batch_slot()

    def _blame(self, pool_name: str, url: str) -> None:
        """A replica that broke a stream counts it as a failure (three in a row eject it), resumed or not."""
        pool = self.gw.pools.get(pool_name)
        replica = pool.replicas.get(url) if pool is not None else None
        if replica is not None:
            replica.record_failure(self.gw.clock(), answered=True)

    async def _open(self, failed: set[str], prefer: str | None = None) -> Leg | None:
        """The continuation's stream, open on the first target that takes it (sent through `Upstream.resume`);
        None when none does. A target whose /tokenize gives no ids cannot resume it. `prefer`: the replica to try
        first (a paused stream's own, whose prefix cache likely still holds it); it is then not blamed."""
        again = self.api == "chat" and self.done == 0  # nothing committed: the chat request again
        targets = self.choose(failed)
        if prefer is not None:
            targets.sort(key=lambda t: t.replica.url != prefer)
        for target in targets[:3]:
            if again:
                path, payload = self.record.path, self.payload
            else:
                prompt = await self._prompt_ids(target.pool, target.replica)
                if prompt is None:
                    failed.add(target.replica.url)
                    continue
                path = "/v1/completions"
                payload = resume_payload(self.body, self.api, self.gw.config.model, prompt,
                                         self.generated[: self.done].tolist())
            opened = await self.send_leg(target, path, payload, self.prompt_tokens + self.done + 1)
            if isinstance(opened, tuple):
                if prefer is None:
                    self._blame(self.record.pool, self.record.replica)  # the last one is judged when it ends
                self.record.pool, self.record.replica = target.pool.name, target.replica.url
                return Leg(target.replica, opened[0], opened[1], "chat" if again else "completions")
            failed.add(target.replica.url)
        return None

    async def _prompt_ids(self, pool: PoolRuntime, replica: Replica) -> bytes | None:
        """The prompt's ids as JSON text: the client's own (completions), else from the target's /tokenize (same
        tokenizer and template as the first replica), once per stream; None when the target cannot give them (any
        failure: refused, an error, a malformed answer). A refused connection drains the replica."""
        if self.prompt_ids is not None:
            return self.prompt_ids
        prompt = self.body.get("prompt")
        if self.api == "completions" and isinstance(prompt, list):
            self.prompt_ids = orjson.dumps(prompt)[1:-1]
        else:
            assert self.gw.session is not None
            answer = await post_tokenize(self.gw.session, replica.url, orjson.dumps(
                tokenize_body(self.body, self.api, self.gw.config.model)), pool.probe_headers())
            if answer.shutting_down:
                replica.start_draining("connection refused" if answer.refused else "refused a request (shutting down)")
            self.prompt_ids = answer.ids()
        if self.prompt_ids is not None:
            self.prompt_tokens = self.prompt_tokens or self.prompt_ids.count(b",") + 1
        return self.prompt_ids

    # relaying a continuation ---------------------------------------------------------------------------------------
    async def _relay(self, leg: Leg, send: Send) -> bool:
        """Relays one continuation as the client's stream; True when the answer ended, False when this leg failed
        too (what the client has seen is kept exact as it goes)."""
        del self.generated[self.done:]  # ids the client never saw the effect of are generated again
        if leg.kind == "chat":
            again = _Again(self.state)
            handle: Callable[[dict[str, Any]], bytes] = lambda obj: self._chat_again(obj, again)
        elif self.api == "chat":
            parser = M3StreamParser(self.state, self.body.get("tools"))
            handle = lambda obj: self._chat_event(obj, parser)
        else:
            handle = self._completions_event
        progress = SseFilter(False)  # the stall watch's view of this leg
        key = self.watch.add(progress, leg.held, leg.replica, self.stall_timeout_s)
        self.aborted = False
        self.current = (leg.held, progress)
        try:
            return await self._pump(leg, send, handle, progress)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False
        finally:
            self.current = None
            self.watch.remove(key)
            if leg.kind == "chat" and self.finish is None and again.replayed:  # its chunks are the record now
                self.generated = again.ids
                self._cut(list(again.marks), not again.evicted)

    async def _pump(self, leg: Leg, send: Send, handle: Callable[[dict[str, Any]], bytes],
                    progress: SseFilter) -> bool:
        assert leg.held.response is not None
        content, buf = leg.held.response.content, leg.data
        scanner = self.record.session.scanner if self.record.session is not None else None
        while True:
            cut = buf.rfind(b"\n\n")
            if cut >= 0:
                events, buf = buf[:cut].split(b"\n\n"), buf[cut + 2:]
                progress.events += len(events)
                out = []
                for event in events:
                    obj = event_json(event)
                    if obj is not None:
                        if self.finish is not None:  # past the finish chunk: only the usage chunk's fingerprint
                            self._keep_fingerprint(obj)
                            continue
                        out.append(handle(obj))
                    if self.aborted:
                        break
                if self.finish is not None:
                    if self.include_usage:  # only the usage chunk written at the end carries it
                        await self._read_fingerprint(content, buf)
                    out.append(self._ending())
                body = b"".join(out)
                if body:
                    progress.waiting = True  # a slow client is no stalled replica
                    await self._write(send, body, scanner, end=self.finish is not None)
                    progress.waiting = False
                if self.finish is not None:
                    return True
                if self.aborted:
                    return False
            chunk = await content.readany()
            if not chunk:
                return False
            buf += chunk

    def _keep_fingerprint(self, obj: dict[str, Any]) -> None:
        fingerprint = obj.get("system_fingerprint")
        if isinstance(fingerprint, str):
            self.fingerprint = fingerprint

    async def _read_fingerprint(self, content: Any, buf: bytes) -> None:
        """The replica's usage chunk follows its finish chunk at once, with the `system_fingerprint` an uninterrupted
        stream ends with: read up to it (briefly; without it the stream ends without a fingerprint)."""
        try:
            async with asyncio.timeout(FINGERPRINT_WAIT_S):
                while self.fingerprint is None:
                    *events, buf = buf.split(b"\n\n")
                    for event in events:
                        obj = event_json(event)
                        if obj is not None:
                            self._keep_fingerprint(obj)
                    if self.fingerprint is not None or b"[DONE]" in b"".join(events):
                        return
                    chunk = await content.readany()
                    if not chunk:
                        return
                    buf += chunk
        except (TimeoutError, aiohttp.ClientError, OSError):
            return

    async def _write(self, send: Send, body: bytes, scanner: Any = None, end: bool = False) -> None:
        if scanner is not None:
            scanner.feed(body)
        await send({"type": "http.response.body", "body": body, "more_body": not end})

    # each continuation event into the client's chunk (b"": nothing to show) ---------------------------------------
    def _chunk(self, obj: dict[str, Any]) -> bytes:
        return sse_event({**obj, **self.head})

    def _completions_event(self, obj: dict[str, Any]) -> bytes:
        """A completions client: the continuation's chunks as they are, under the stream's id, created, model; an
        abort chunk's text and ids are the client's too."""
        choices = obj.get("choices")
        if not choices:
            return b""  # the leg's usage: the stream's own is written at the end
        choice = choices[0]
        reason = choice.get("finish_reason")
        self.generated.extend(choice.get("token_ids") or ())
        self.done = len(self.generated)
        choice["token_ids"] = None
        if "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None
        if reason == "abort":
            self.aborted, choice["finish_reason"] = True, None
            return self._chunk(obj) if choice.get("text") else b""
        self.finish = reason
        return self._chunk(obj)

    def _chat_event(self, obj: dict[str, Any], parser: M3StreamParser) -> bytes:
        """A chat client, a token-id continuation: its raw text through the M3 parser into chat deltas. The parser's
        state after every event is where the next cut resumes, a held-back partial marker included."""
        choices = obj.get("choices")
        if not choices:
            return b""
        choice = choices[0]
        reason = choice.get("finish_reason")
        self.aborted = reason == "abort"
        delta = parser.feed(choice.get("text") or "")
        if reason is not None and not self.aborted:
            for key, value in parser.finish().items():
                delta[key] = delta.get(key, [] if key == "tool_calls" else "") + value
        self.generated.extend(choice.get("token_ids") or ())
        self.done, self.state = len(self.generated), parser.state
        self.tools_called = self.tools_called or parser.state.tools_called
        if reason is not None and not self.aborted:
            self.finish = chat_finish_reason(self.body, reason, self.tools_called)
        elif not delta:
            return b""
        return sse_event(chat_chunk(self.head, delta, self.finish))

    def _chat_again(self, obj: dict[str, Any], again: _Again) -> bytes:
        """A chat client with nothing committed: the same chat request on another replica, its role chunk and
        what the client already saw (text, tool-call announcements) left out."""
        if isinstance(obj.get("prompt_token_ids"), list):  # the role chunk: the prompt's ids, for the usage
            self.prompt_tokens = self.prompt_tokens or len(obj["prompt_token_ids"])
        choices = obj.get("choices")
        if not choices:
            return b""
        choice = choices[0]
        reason, delta = choice.get("finish_reason"), choice.get("delta") or {}
        before = len(again.ids)
        again.ids.extend(choice.get("token_ids") or ())
        choice["token_ids"] = None
        self.aborted = reason == "abort"
        if delta.pop("role", None) is not None:
            return b""
        if any(delta.values()):
            delta = again.shown(delta, before)
            choice["delta"] = delta
        self.tools_called = self.tools_called or bool(delta.get("tool_calls"))
        if reason is not None and not self.aborted:
            self.finish = reason
            self.generated = again.ids
        elif self.aborted:
            choice["finish_reason"] = None
        if self.finish is None and not any(v for v in delta.values()):
            return b""
        return self._chunk({**obj, "object": "chat.completion.chunk"})

    def _final_chunk(self) -> bytes:
        """The finish chunk no continuation wrote: every token the client allowed is out."""
        self.finish = "length"
        if self.api == "chat":
            return sse_event(chat_chunk(self.head, {}, "length"))
        return sse_event(completion_chunk(self.head, "", "length"))

    def _ending(self, usage: dict[str, Any] | None = None) -> bytes:
        """The stream's end: the usage chunk if the client asked for it and has not got it, then [DONE]. `usage`:
        the replica's own, when it came ({} when the client has it already); else counted here."""
        counted = stream_usage(self.prompt_tokens or self.record.prompt_tokens_est, len(self.generated))
        self.record.usage = usage or counted
        if self.include_usage and usage is None:
            chunk = usage_chunk(self.head, self.api, counted)
            if self.fingerprint is not None:
                chunk["system_fingerprint"] = self.fingerprint
            return sse_event(chunk) + STREAM_DONE
        return STREAM_DONE
