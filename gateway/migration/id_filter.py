"""`IdFilter`: the relay filter of every resumable stream (the package's docstring says where it fits).

The replica was asked for `return_token_ids`; the filter keeps the generated ids (array('I'), 4 bytes a token),
turns the ids back into the `null` the client would have got (byte slicing, no JSON parsing; a 1M-token prompt's
~7 MB of `prompt_token_ids` is sliced out unread, its ids counted), drops the chunks vLLM sends only because ids were
asked for (held-back tokens, empty delta), relays an abort chunk's last delta, and notices a replica-side end:
`finish_reason: "abort"` or an error event. Its cost is a few byte searches per event.
"""

from __future__ import annotations

from array import array
from collections import deque

import orjson

from gateway.relay import SseFilter
from policies.migration import Mark
from policies.vllm_wire import event_json

_IDS, _PROMPT_IDS, _NO_IDS = b'"token_ids":[', b'"prompt_token_ids":[', b'"token_ids":null'
_GOING_ON, _FINISHED, _HELD_BACK = b'"finish_reason":null', b'"finish_reason":"', b'"delta":{}'
RECENT_CHUNKS = 16  # a chat stream's last chunks the client saw, kept to find the cut (text, tool calls)


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
        if b'"finish_reason":"' in event and b'"finish_reason":"abort"' not in event:
            self.finished = True  # a finish chunk without ids (none is expected, but it is a finish all the same)
        if b'"usage"' in event and not self.finished and b'"choices":[]' in event:
            # the usage chunk before any finish: the replica ended an answer it had not finished, with no last
            # delta to carry the abort (vLLM's shutdown aborting a request before its first token): a cut
            self.failure = "abort"
            return b""
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
            obj = event_json(event)
            choices = obj.get("choices") if obj else None
            if choices:
                out.append(Mark(before, after, choices[0].get("delta") or {}))
        return out
