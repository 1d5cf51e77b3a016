"""IdFilter (gateway/migration/) relays a stream the same whether its events come one per read or many per read:
the bulk path for plain token events must give the bytes, ids and cut context the per-event path gives."""

from __future__ import annotations

import random

import orjson

from gateway.migration import RECENT_CHUNKS, IdFilter


def _chat_events(ids_per_event: list[list[int]], finish: str = "length") -> list[bytes]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], "prompt_token_ids": [5, 6, 7]}]
    for i, ids in enumerate(ids_per_event):
        delta = {} if not ids else {"content": f" w{i}"}
        out.append({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
                                         "token_ids": ids}]})
    out.append({**head, "choices": [{"index": 0, "delta": {"content": "."}, "logprobs": None,
                                     "finish_reason": finish, "token_ids": [99]}]})
    out.append({**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}})
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in out] + [b"data: [DONE]\n\n"]


def _completion_events(ids_per_event: list[list[int]]) -> list[bytes]:
    out = []
    for i, ids in enumerate(ids_per_event):
        out.append({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [
            {"index": 0, "text": f" w{i}", "logprobs": None, "finish_reason": None, "stop_reason": None,
             "prompt_token_ids": [5, 6, 7] if i == 0 else None, "token_ids": ids}]})
    return [b"data: " + orjson.dumps(e) + b"\n\n" for e in out] + [b"data: [DONE]\n\n"]


def _run(events: list[bytes], chat: bool, reads: list[bytes]) -> tuple[bytes, IdFilter]:
    filt = IdFilter(True, chat)
    out = b"".join(filt.feed(r) for r in reads) + filt.remainder()
    return out, filt


def _splits(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), 12))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


def _same(events: list[bytes], chat: bool) -> tuple[bytes, IdFilter]:
    one, ref = _run(events, chat, events)  # one event a read: the per-event path
    data = b"".join(events)
    rng = random.Random(7)
    for reads in ([data], [events[0], b"".join(events[1:])], _splits(data, rng), _splits(data, rng)):
        out, filt = _run(events, chat, reads)
        assert out == one
        assert filt.ids == ref.ids and filt.events == ref.events and filt.finished == ref.finished
        assert filt.recent_events() == ref.recent_events() and filt.usage == ref.usage
    return one, ref


def test_chat_bulk_and_per_event_agree() -> None:
    ids = [[100 + i] for i in range(40)]
    ids[10], ids[20] = [], [200, 201]  # a held-back chunk (empty delta, no ids) and a two-token chunk
    one, ref = _same(_chat_events(ids), chat=True)
    assert b'"token_ids":[' not in one and b'"prompt_token_ids":[' not in one
    assert one.count(b'"token_ids":null') == 40  # 39 shown token chunks + the finish; the held-back one dropped
    assert b'"usage"' not in one and one.endswith(b"data: [DONE]\n\n")
    assert list(ref.ids) == [i for chunk in ids for i in chunk] + [99]
    recent = ref.recent_events()
    assert len(recent) == RECENT_CHUNKS
    assert recent[-1][1] == len(ref.ids) - 1  # the last shown chunk ends before the finish's id
    assert all(b - a == (2 if b'" w20"' in e else 1) for a, b, e in recent)


def test_completions_bulk_and_per_event_agree() -> None:
    one, ref = _same(_completion_events([[100 + i] for i in range(30)]), chat=False)
    assert b'"token_ids":[' not in one and b'"prompt_token_ids":[' not in one
    assert list(ref.ids) == [100 + i for i in range(30)]


def test_abort_in_a_bulk_read_stops_relaying_after_its_last_delta() -> None:
    """vLLM's abort chunk carries the step's last delta: the client gets it (as a plain chunk), the cut counts it."""
    events = _chat_events([[100 + i] for i in range(20)], finish="abort")
    out, filt = _run(events, True, [b"".join(events)])
    assert filt.failure == "abort" and not filt.finished
    assert b'"abort"' not in out and b"[DONE]" not in out and out.count(b'"token_ids":null') == 21
    assert out.endswith(b'"delta":{"content":"."},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n')
    assert filt.ids[-1] == 99 and filt.recent_events()[-1][:2] == (20, 21)


def test_a_completions_abort_chunk_with_text_is_relayed_and_an_empty_one_dropped() -> None:
    for text, shown in (("tail", True), ("", False)):
        events = _completion_events([[100 + i] for i in range(3)])
        abort = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": "abort", "stop_reason": None,
             "prompt_token_ids": None, "token_ids": [7] if text else []}]}
        events.insert(3, b"data: " + orjson.dumps(abort) + b"\n\n")
        out, filt = _run(events, False, [b"".join(events)])
        assert filt.failure == "abort" and (b'"text":"tail","logprobs":null,"finish_reason":null' in out) == shown
        assert list(filt.ids) == [100, 101, 102] + ([7] if text else []) and filt.prompt_tokens == 3


def test_a_usage_chunk_before_any_finish_is_a_cut() -> None:
    """vLLM's shutdown aborting a request before its first token sends no abort chunk (its output is empty), only
    the usage chunk and [DONE]: the answer never finished, so the stream is cut (and resumed), not ended."""
    for chat in (True, False):
        events = _chat_events([]) if chat else _completion_events([])
        usage = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}}
        events = [e for e in events if b'"finish_reason":"length"' not in e and b'"usage"' not in e]
        events.insert(len(events) - 1, b"data: " + orjson.dumps(usage) + b"\n\n")
        out, filt = _run(events, chat, [b"".join(events)])
        assert filt.failure == "abort" and not filt.finished, chat
        assert b'"usage"' not in out and b"[DONE]" not in out
    finished, filt = _run(_chat_events([[1], [2]]), True, [b"".join(_chat_events([[1], [2]]))])
    assert filt.failure is None and filt.finished and b"[DONE]" in finished  # the usage after a finish ends it
