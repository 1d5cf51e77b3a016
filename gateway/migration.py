"""Stream migration: a stream whose replica fails after the first byte goes on, token for token, on another replica.

Three parts (the mechanism and its reasons: docs/stream-migration.md):

- `IdFilter`, on every resumable stream's relay: the replica was asked for `return_token_ids`; the filter keeps
  the generated ids (array('I'), 4 bytes a token), turns the ids back into the `null` the client would have got
  (byte slicing, no JSON parsing; a 1M-token prompt's ~7 MB of `prompt_token_ids` is sliced out unread), drops the
  chunks vLLM sends only because ids were asked for (held-back tokens, empty delta), and notices a replica-side
  end: `finish_reason: "abort"` or an error event. Its cost is a few byte searches per event.
- `StallWatch`: one ticker for all live streams; a stream silent longer than the stall timeout (or silent while its
  replica is ejected or unhealthy) is closed, which turns it into a failure the relay then migrates.
- `Resumer.run`: on a failure, picks another replica (the coordinator's choice, the failed ones excluded), resumes
  through `/v1/completions` with the prompt's ids (POST /tokenize there) plus the committed generated ids, and
  relays the continuation as the same stream: chat's raw text goes through `policies.m3_stream` back into deltas.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from starlette.types import Send

from gateway.record import RequestRecord
from gateway.relay import Held, SseFilter, stream_error_event
from gateway.runtime import Gateway
from policies.m3_stream import M3StreamParser, ParserState
from policies.migration import Mark, chat_cut, chat_finish_reason, nothing_left, resume_payload
from policies.vllm_wire import connection_refused, refuses_new_requests, tokenize_body, tokenize_ids
from pools.replicas import PoolRuntime, Replica
from pools.tasks import cancel_and_wait

_IDS, _PROMPT_IDS, _NO_IDS = b'"token_ids":[', b'"prompt_token_ids":[', b'"token_ids":null'
_GOING_ON, _FINISHED, _HELD_BACK = b'"finish_reason":null', b'"finish_reason":"', b'"delta":{}'
RECENT_CHUNKS = 16  # a chat stream's last chunks the client saw, kept to find the cut (text, tool calls)
EJECTED_SILENCE_S = 1.0  # a stream this silent on an ejected or unhealthy replica is given up on


class IdFilter(SseFilter):
    """SseFilter for a resumable chat/completions stream asked for `return_token_ids` (see the module's docstring).

    `recent`: (ids before, ids after, event) of the last chunks the client saw in full (chat); `failure`: why the
    replica's stream cannot go on though it may still send bytes ("abort", "error")."""

    __slots__ = ("ids", "chat", "recent", "head", "finished", "prompt_tokens", "evicted", "_prompt_seen",
                 "_recent_events")

    def __init__(self, strip_usage: bool, chat: bool) -> None:
        super().__init__(strip_usage)
        self.ids = array("I")
        self.chat = chat
        # (ids before, each event's raw ids, the events as relayed): the last reads, RECENT_CHUNKS events or more
        self.recent: deque[tuple[int, list[bytes], bytes]] = deque()
        self._recent_events = 0
        self.head = b""  # the first event (its id, created, model are the stream's)
        self.failure: str | None = None
        self.finished = False  # the answer's finish_reason came
        self.prompt_tokens = 0  # the prompt's ids, counted as they are stripped
        self.evicted = False  # `recent` lost its oldest chunks: it no longer begins with the answer
        self._prompt_seen = False

    def feed(self, chunk: bytes) -> bytes:
        complete = self._complete(chunk)
        if not complete or self.failure is not None:
            return b""
        out = b""
        if not self.head or (not self._prompt_seen and _PROMPT_IDS in complete):  # the stream's first event
            first = complete.find(b"\n\n")
            out, complete = self._event(complete[:first]), complete[first + 2:]
            if not complete or self.failure is not None:
                return out
            if not self.head or (not self._prompt_seen and _PROMPT_IDS in complete):
                return out + self._events(complete)
        if complete.find(b"\n\n") == len(complete) - 2:  # one event: the usual read at decode pace
            return out + self._one(complete)
        end = self._plain_end(complete)
        return out + self._tokens(complete[:end]) + self._events(complete[end:])

    def _one(self, event: bytes) -> bytes:
        """One whole event (with its blank line): a plain token event in a few byte operations; anything else
        (a finish, usage, [DONE], an error, a held-back chunk) through `_event`."""
        i = event.find(_IDS)
        if i < 0 or _GOING_ON not in event or (self.chat and _HELD_BACK in event):
            return self._event(event[:-2])
        j = event.find(b"]", i + 13)
        raw = event[i + 13:j]
        before = len(self.ids)
        if raw:
            if b"," in raw:
                self._keep([raw])
            else:
                self.ids.append(int(raw))
        self.events += 1
        out = event[: i + 12] + b"null" + event[j + 1:]
        if self.chat:
            self._remember(before, [raw], out)
        return out

    def _plain_end(self, complete: bytes) -> int:
        """Where the leading run of plain token events ends: the start of the first event with a finish_reason
        (then usage, [DONE]) or, in chat, of one held back."""
        end = len(complete)
        for marker in (_FINISHED, _HELD_BACK) if self.chat else (_FINISHED,):
            at = complete.find(marker, 0, end)
            if at >= 0:
                i = complete.rfind(b"\n\n", 0, at)
                end = i + 2 if i >= 0 else 0
        return end

    def _events(self, complete: bytes) -> bytes:
        """Whole events, one by one."""
        if not complete:
            return b""
        if complete.find(b"\n\n") == len(complete) - 2:
            return self._event(complete[:-2])
        return b"".join([self._event(event) for event in complete.split(b"\n\n")[:-1]])

    def _tokens(self, complete: bytes) -> bytes:
        """Whole events that should each carry ids and go on (no finish, nothing held back): a few C calls whatever
        their number (a read often holds many), not Python per event; one by one if they do not all."""
        if not complete:
            return b""
        n = complete.count(b"\n\n")
        pieces = complete.split(_IDS)
        if len(pieces) != n + 1 or complete.count(_GOING_ON) != n:
            return self._events(complete)
        self.events += n
        parts = [piece.partition(b"]") for piece in pieces[1:]]
        raw = [part[0] for part in parts]
        before = len(self.ids)
        self._keep(raw)
        pieces[1:] = [part[2] for part in parts]
        out = _NO_IDS.join(pieces)
        if self.chat:
            self._remember(before, raw, out)
        return out

    def _keep(self, raw: list[bytes]) -> None:
        """The generated ids, from their decimal text (`raw`: each event's, comma-separated)."""
        text = b",".join(raw)
        try:
            self.ids.extend(orjson.loads(b"[" + text + b"]"))
        except orjson.JSONDecodeError:  # an event with no ids: `[]`
            self.ids.extend(int(x) for x in text.split(b",") if x)

    def _remember(self, before: int, raw: list[bytes], out: bytes) -> None:
        """Keeps the events just relayed for a cut, and older reads only while the last RECENT_CHUNKS need them."""
        recent = self.recent
        recent.append((before, raw, out))
        self._recent_events += len(raw)
        while self._recent_events - len(recent[0][1]) >= RECENT_CHUNKS:
            self._recent_events -= len(recent.popleft()[1])
            self.evicted = True

    def recent_events(self) -> list[tuple[int, int, bytes]]:
        """(ids before, ids after, event) of the last RECENT_CHUNKS chunks the client saw in full (at a cut only)."""
        out = []
        for before, raw, events in self.recent:
            for ids, event in zip(raw, events.split(b"\n\n")):
                after = before + (ids.count(b",") + 1 if ids else 0)
                out.append((before, after, event))
                before = after
        return out[-RECENT_CHUNKS:]

    def _event(self, event: bytes) -> bytes:
        self.events += 1
        if self.failure is not None:
            return b""
        i = event.find(_IDS)
        if i < 0:
            return self._other(event)
        j = event.find(b"]", i + 13)
        before = len(self.ids)
        raw = event[i + 13:j] if j > i + 13 else b""
        if raw:
            self._keep([raw])
        event = event[: i + 12] + b"null" + event[j + 1:]
        if not self._prompt_seen:  # completions: the first chunk of the choice carries the prompt's ids
            event = self._strip_prompt(event)
            self.head = self.head or event
        if b'"finish_reason":null' not in event:
            if b'"finish_reason":"abort"' in event:  # the replica stopped it (shutdown): not the client's answer
                self.failure = "abort"
                return self._last_delta(before, raw, event)
            self.finished = True
        elif self.chat:
            if b'"delta":{}' in event:  # held back by the parser: sent only because ids were asked for
                return b""
            event += b"\n\n"
            self._remember(before, [raw], event)
            return event
        return event + b"\n\n"

    def _last_delta(self, before: int, raw: bytes, event: bytes) -> bytes:
        """vLLM's abort chunk carries the step's last delta (text and ids): the client gets it as a plain chunk and
        the cut counts it; an empty one is dropped."""
        if (b'"delta":{}' in event) if self.chat else (b'"text":""' in event):
            return b""
        event = event.replace(b'"finish_reason":"abort"', b'"finish_reason":null', 1) + b"\n\n"
        if self.chat:
            self._remember(before, [raw], event)
        return event

    def _other(self, event: bytes) -> bytes:
        """An event without ids: [DONE], chat's role chunk (the prompt's ids), the usage chunk, an error."""
        if event.endswith(b"[DONE]"):
            self.saw_done = True
            return event + b"\n\n"
        if not self._prompt_seen and _PROMPT_IDS in event:
            event = self._strip_prompt(event)
        if not self.head:
            self.head = event
        if b'"usage"' in event and self._take_usage(event) and self.strip_usage:
            return b""
        if event.startswith(b'data: {"error"') or b'"object":"error"' in event:
            self.failure = "error"
            return b""
        return event + b"\n\n"

    def _strip_prompt(self, event: bytes) -> bytes:
        i = event.find(_PROMPT_IDS)
        if i < 0:
            return event
        self._prompt_seen = True
        j = event.find(b"]", i + 20)
        self.prompt_tokens = event.count(b",", i + 20, j) + 1 if j > i + 20 else 0
        return event[: i + 19] + b"null" + event[j + 1:]

    def marks(self) -> list[Mark]:
        """The recent chunks as parsed marks (at a cut only)."""
        out = []
        for before, after, event in self.recent_events():
            obj = _json(event)
            choices = obj.get("choices") if obj else None
            if choices:
                out.append(Mark(before, after, choices[0].get("delta") or {}))
        return out


def _json(event: bytes) -> dict[str, Any] | None:
    at = event.find(b"data:")
    try:
        obj = orjson.loads(event[at + 5:]) if at >= 0 else None
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


class StallWatch:
    """One ticker over every live resumable stream: closes a stream that has been silent longer than its stall
    timeout, or for EJECTED_SILENCE_S while its replica is ejected or has failed more than one health probe in a
    row (one failed probe — a busy replica's slow /health — is no sign of a dead one). A draining vLLM past its
    --shutdown-timeout leaves the connection open and sends nothing; this is how that is noticed. Time the relay
    spends waiting on a slow client (`SseFilter.waiting`) is no silence: the replica is not read then. The ticker
    runs from `start` to `stop` (the app's lifespan): a task and a timer per stream cost more than a tick every
    0.25 s. Used without them (an app without its lifespan), it runs while any stream is live."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, probe_interval_s: float = 0.0) -> None:
        self.clock = clock
        self.probe_interval_s = probe_interval_s
        self._live: dict[int, list[Any]] = {}
        self._task: asyncio.Task[None] | None = None
        self._started = False

    def add(self, filt: SseFilter, held: Held, replica: Replica, timeout: float) -> int:
        key = id(held)
        # filter, held, replica, timeout, events seen, since when, since when its replica looks down (0: it does not)
        self._live[key] = [filt, held, replica, timeout, filt.events, self.clock(), 0.0]
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._tick())
        return key

    def remove(self, key: int) -> None:
        self._live.pop(key, None)

    def start(self) -> None:
        self._started = True
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> None:
        self._started = False
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _tick(self) -> None:
        try:
            while self._live or self._started:
                await asyncio.sleep(0.25)
                now = self.clock()
                for key, entry in list(self._live.items()):
                    if entry[1].response is None:  # the stream ended (its Held was released)
                        del self._live[key]
                    else:
                        self.check(entry, now)
        finally:
            self._task = None

    def check(self, entry: list[Any], now: float) -> None:
        """One stream at one tick: progress (or a wait on the client) restarts its clock; else it may be cut."""
        filt, held, replica, timeout, seen, since, _ = entry
        if filt.events != seen or filt.waiting:
            entry[4], entry[5] = filt.events, now
            return
        down = now < replica.ejected_until or not replica.healthy
        entry[6] = (entry[6] or now) if down else 0.0
        silent = now - since
        dead = now < replica.ejected_until or (down and now - entry[6] > self.probe_interval_s)
        if silent > timeout or (silent > EJECTED_SILENCE_S and dead):
            filt.failure = filt.failure or "stall"
            if held.response is not None:
                held.response.close()  # the relay's read ends: a failure it migrates


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

    def parts(self, held: Held, replica: Replica, strip_usage: bool) -> tuple[SseFilter | None, Any]:
        """The first leg's filter and the relay's resume hook: the id-keeping filter, watched for stalls, when the
        stream can be resumed; else the plain filter and a hook that counts it refused and ends it."""
        if self.refused is not None:
            return None, self._refuse
        filt = IdFilter(strip_usage, chat=self.api == "chat")
        self.first = held
        self.watch.add(filt, held, replica, self.stall_timeout_s)
        return filt, self.run

    async def _refuse(self, send: Send, filt: SseFilter, failure: str) -> None:
        self.gw.telemetry.migration(self.record, "refused", 0, "")
        self.record.error = f"upstream failed mid-stream: {self.reason_text(failure)}; not resumable ({self.refused})"
        tail = filt.remainder() + stream_error_event(self.api, "the replica failed mid-stream; retry the request")
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def reason_text(self, failure: str) -> str:
        return {"abort": "the replica aborted the stream", "error": "the replica sent an error mid-stream",
                "stall": "the replica went silent"}.get(failure, failure)

    # the cut ------------------------------------------------------------------------------------------------------
    def start_from(self, filt: IdFilter) -> None:
        """The first leg's ids, head and cut: chat resumes at `chat_cut`, completions after every id relayed."""
        self.generated = filt.ids
        self.prompt_tokens = filt.prompt_tokens
        head = _json(filt.head) or {}
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
        if self.first is not None:
            self.first.close(abort=True)  # the failed replica's in-flight count ends with its leg
        self.start_from(filt)
        if filt.finished:
            record.error = None
            await self._write(send, self._ending(usage=None if self.include_usage and filt.usage is None
                                                 else filt.usage or {}), end=True)
            return
        record.t_cut = record.t_cut or self.gw.clock()
        failed = {record.replica}
        for _ in range(self.max_migrations):
            if nothing_left(self.body, self.api, self.done):  # died after its last token: the end is ours to write
                self.gw.telemetry.migration(record, "resumed", self.done, "")
                del self.generated[self.done:]
                await self._write(send, self._final_chunk() + self._ending(), end=True)
                return
            leg = await self._open(failed)
            if leg is None:
                break
            self.gw.telemetry.migration(record, "resumed", self.done, leg.replica.url)
            try:
                ok = await self._relay(leg, send)
            finally:
                leg.held.close(abort=True)
            if ok:
                record.error = None
                return
            failed.add(leg.replica.url)
        self.gw.telemetry.migration(record, "failed", self.done, "")
        record.error = f"upstream failed mid-stream: {self.reason_text(failure)}; not resumed"
        await self._write(send, stream_error_event(
            self.api, "the replica failed mid-stream and no other replica could resume it; retry the request"),
            end=True)

    def _blame(self, pool_name: str, url: str) -> None:
        """A replica that broke a stream counts it as a failure (three in a row eject it), resumed or not."""
        pool = self.gw.pools.get(pool_name)
        replica = pool.replicas.get(url) if pool is not None else None
        if replica is not None:
            replica.record_failure(self.gw.clock(), answered=True)

    async def _open(self, failed: set[str]) -> Leg | None:
        """The continuation's stream, open on the first target that takes it (sent through `Upstream.resume`);
        None when none does. A target whose /tokenize gives no ids cannot resume it."""
        again = self.api == "chat" and self.done == 0  # nothing committed: the chat request again
        for target in self.choose(failed)[:3]:
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
            query = tokenize_body(self.body, self.api, self.gw.config.model)
            assert self.gw.session is not None
            try:
                async with self.gw.session.post(replica.url + "/tokenize", data=orjson.dumps(query), headers={
                        "content-type": "application/json", **pool.probe_headers()},
                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    answer = await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, OSError) as exc:
                if connection_refused(exc):
                    replica.start_draining("connection refused")
                return None
            if refuses_new_requests(status, answer):
                replica.start_draining("refused a request (shutting down)")
            self.prompt_ids = tokenize_ids(answer) if status == 200 else None
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
        try:
            return await self._pump(leg, send, handle, progress)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False
        finally:
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
                    obj = _json(event)
                    if obj is not None:
                        out.append(handle(obj))
                    if self.finish is not None or self.aborted:
                        break
                if self.finish is not None:
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

    async def _write(self, send: Send, body: bytes, scanner: Any = None, end: bool = False) -> None:
        if scanner is not None:
            scanner.feed(body)
        await send({"type": "http.response.body", "body": body, "more_body": not end})

    # each continuation event into the client's chunk (b"": nothing to show) ---------------------------------------
    def _chunk(self, obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({**obj, **self.head}) + b"\n\n"

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
        return self._chat_chunk(delta, self.finish)

    def _chat_chunk(self, delta: dict[str, Any], reason: str | None) -> bytes:
        return self._chunk({"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]})

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
            return self._chat_chunk({}, "length")
        return self._chunk({"object": "text_completion", "choices": [
            {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]})

    def _ending(self, usage: dict[str, Any] | None = None) -> bytes:
        """The stream's end: the usage chunk if the client asked for it and has not got it, then [DONE]. `usage`:
        the replica's own, when it came ({} when the client has it already); else counted here."""
        if not usage:
            prompt = self.prompt_tokens or self.record.prompt_tokens_est
            counted = {"prompt_tokens": prompt, "total_tokens": prompt + len(self.generated),
                       "completion_tokens": len(self.generated)}
        self.record.usage = usage or counted
        out = b""
        if self.include_usage and usage is None:
            kind = "chat.completion.chunk" if self.api == "chat" else "text_completion"
            out = self._chunk({"object": kind, "choices": [], "usage": counted})
        return out + b"data: [DONE]\n\n"
