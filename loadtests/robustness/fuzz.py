"""Hostile and malformed input against a live gateway: schemathesis cases from deploy/openapi.yaml, hypothesis
mutations of valid requests, a hand-written corpus, and connection-level attacks.

    python -m loadtests.robustness.fuzz                  10,000 cases (`make fuzz`)
    python -m loadtests.robustness.fuzz --cases 1500     the CI size (tests/fuzz runs it under pytest)

One gateway (`m3gate serve`, client keys on, admin key on, `state:` on a private Redis) in front of two simulated
replicas (instant, short answers), all on 127.0.0.1. Every case is one HTTP exchange; each answer is checked:

- no 5xx made by the gateway itself (a 5xx relayed from a replica carries `x-m3gate-endpoint` and is counted apart);
- every 4xx in OpenAI's error shape `{"error": {"message": str, "type": str, ...}}`;
- the gateway never drops a connection without an answer, and the process is alive at the end;
- no outbound connection: image/video URLs point at a loopback port this module listens on, and nothing connects;
- RSS of the gateway process back near its warmed-up baseline once the fuzzing is over;
- the gateway's log holds no traceback.

Connection-level attacks (not counted as cases): 10 MB and 200 MB bodies (declared and chunked), slowloris bodies
and headers, many connections that never send, CR/LF injection in raw headers.
"""

from __future__ import annotations

import argparse
import base64
import gc
import hashlib
import json
import random
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.cli.launcher import GatewayProcess, start_gateway
from loadtests.lib.harness import write_results
from loadtests.lib.private_redis import PrivateRedis
from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
CLIENT_KEY = "fuzz-client-key-0123456789abcdef"
ADMIN_KEY = "fuzz-admin-key-0123456789abcdef"
OPENAPI = Path(__file__).resolve().parents[2] / "deploy" / "openapi.yaml"
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}


# -- the target ----------------------------------------------------------------------------------------------------


@dataclass
class Target:
    gateway: GatewayProcess
    sims: list[SimProcess]
    redis: PrivateRedis

    @property
    def url(self) -> str:
        return self.gateway.url

    def rss(self) -> int:
        import psutil

        return int(psutil.Process(self.gateway.pid).memory_info().rss)

    def fds(self) -> int:
        import psutil

        return int(psutil.Process(self.gateway.pid).num_fds())


def gateway_config(sims: Sequence[SimProcess], redis_url: str, body_timeout_s: float = 2.0) -> dict[str, Any]:
    return {
        "model": MODEL,
        "aliases": ["minimax-m3"],
        "pools": [
            {"name": "interactive", "max_model_len": 32768, "modalities": ["text", "image", "video"],
             "endpoints": [s.url for s in sims[0::2]]},
            {"name": "repository", "max_model_len": 131072, "endpoints": [s.url for s in sims[1::2]]},
        ],
        "server": {"health_interval_s": 0.5, "upstream_read_timeout_s": 15},
        "state": redis_url,
        "admin": {"api_key": ADMIN_KEY},
        "access": {"keys": [{"name": "fuzz", "key_sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest(),
                             "requests_per_minute": 10_000_000}]},
        "limits": {"body_read_timeout_s": body_timeout_s},
    }


@contextmanager
def fuzz_target(body_timeout_s: float = 2.0) -> Iterator[Target]:
    redis = PrivateRedis()
    sims: list[SimProcess] = []
    gw: GatewayProcess | None = None
    try:
        redis.start()
        args = ["--instant", "--mean-output-tokens", "8", "--kv-blocks", "1024"]
        for _ in range(2):  # two replicas a pool: one replica's trouble is retried on the other
            sims.append(start_sim(32768, extra_args=[*args, "--modalities", "text,image,video"]))
            sims.append(start_sim(131072, extra_args=args))
        gw = start_gateway(gateway_config(sims, redis.url, body_timeout_s))
        yield Target(gw, sims, redis)
    finally:
        if gw is not None:
            gw.stop()
        for sim in sims:
            sim.stop()
        redis.stop()


# -- checking one answer -------------------------------------------------------------------------------------------


@dataclass
class Tally:
    cases: int = 0
    by_source: Counter[str] = field(default_factory=Counter)
    by_status: Counter[int] = field(default_factory=Counter)
    gateway_5xx: int = 0
    gateway_5xx_codes: Counter[str] = field(default_factory=Counter)
    relayed_5xx: int = 0
    bad_error_shape: int = 0
    no_answer: int = 0
    not_sent: int = 0  # the client library refused to send it (e.g. CR/LF in a header): not a case
    examples: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def problem(self, text: str) -> None:
        if len(self.examples) < 40:
            self.examples.append(text[:700])

    def check(self, source: str, label: str, status: int | None, headers: Any, body: bytes,
              sent: bytes | None = None) -> None:
        with self._lock:
            self.cases += 1
            self.by_source[source] += 1
            if status is None:
                self.no_answer += 1
                self.problem(f"{source} {label}: no answer")
                return
            self.by_status[status] += 1
            relayed = headers is not None and "x-m3gate-endpoint" in headers
            if status >= 500:
                if relayed:
                    self.relayed_5xx += 1
                else:
                    self.gateway_5xx += 1
                    self.gateway_5xx_codes[f"{status} {_error_code(body)}"] += 1
                self.problem(f"{source} {label}: {status} {'(relayed) ' if relayed else ''}{body[:200]!r} "
                             f"for {(sent or b'')[:300]!r}")
            if 400 <= status < 500 and not openai_error_shape(body):
                self.bad_error_shape += 1
                self.problem(f"{source} {label}: {status} not OpenAI-shaped: {body[:200]!r}")


def _error_code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


def openai_error_shape(body: bytes) -> bool:
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    err = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


# -- cases ---------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    source: str
    label: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **extra}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def _png_header(width: int = 64, height: int = 64) -> bytes:
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr
            + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)))


def corpus(trap_url: str) -> list[Case]:
    """The hand-written hostile corpus (each one HTTP exchange)."""
    cases: list[Case] = []

    def add(label: str, body: bytes | dict[str, Any] | list[Any] | None, path: str = "/v1/chat/completions",
            headers: dict[str, str] | None = None, method: str = "POST") -> None:
        raw = body if isinstance(body, bytes) or body is None else _dumps(body)
        cases.append(Case("corpus", label, method, path, raw, {**AUTH, "content-type": "application/json",
                                                                 **(headers or {})}))

    # invalid JSON
    for i, raw in enumerate([b"", b"{", b"}", b"{'model': 1}", b'{"model": "x",}', b"\x00\x01\x02", b"\xff\xfe{}",
                             b"null", b"true", b"[]", b'"string"', b"123", b"NaN", b'{"a": NaN}', b'{"a": Infinity}',
                             b'{"messages": [' * 3, b'{"a":1}{"b":2}', b"\xef\xbb\xbf{}", b'{"\\ud800": 1}',
                             b'{"messages": "\\ud800"}', "{\"m\": \"\u2028\"}".encode(), b"  \n\t ",
                             b'{"model": "' + b"\xc3\x28" + b'"}']):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize"):
            add(f"invalid-json-{i}", raw, path)
    # wrong types, everywhere a chat request has a field
    wrong: list[Any] = [None, True, 0, -1, 1.5, "", "x", [], {}, [1, "a"], {"a": {"b": []}}]
    for key in ("model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "temperature",
                "top_p", "n", "stop", "tools", "tool_choice", "user", "seed", "chat_template_kwargs", "priority",
                "logprobs", "response_format"):
        for j, value in enumerate(wrong):
            add(f"wrong-type-{key}-{j}", _chat(**{key: value}))
    for j, value in enumerate(wrong):
        add(f"wrong-message-{j}", _chat(messages=[value]))
        add(f"wrong-role-{j}", _chat(messages=[{"role": value, "content": "hi"}]))
        add(f"wrong-content-{j}", _chat(messages=[{"role": "user", "content": value}]))
        add(f"wrong-part-{j}", _chat(messages=[{"role": "user", "content": [value]}]))
        add(f"wrong-thinking-{j}", _chat(chat_template_kwargs={"thinking_mode": value}))
        add(f"wrong-prompt-{j}", {"model": MODEL, "prompt": value, "max_tokens": 4}, "/v1/completions")
        add(f"wrong-input-{j}", {"model": MODEL, "input": value}, "/v1/responses")
        add(f"wrong-anthropic-{j}", {"model": MODEL, "max_tokens": 4, "messages": value}, "/v1/messages")
        add(f"wrong-tokenize-{j}", {"model": MODEL, "prompt": value}, "/tokenize")
    # enormous and negative numbers
    for j, raw in enumerate([b"1e308", b"-1e308", b"1e999", b"99999999999999999999999999999", b"-1",
                             b"-9223372036854775808", b"9223372036854775807", b"18446744073709551616", b"0", b"-0",
                             b"0.5", b"1e-400", b"4294967297"]):
        for key in ("max_tokens", "max_completion_tokens", "temperature", "n", "seed", "priority", "top_p"):
            add(f"number-{key}-{j}", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "%s": %s}'
                % (MODEL.encode(), key.encode(), raw))
        add(f"number-anthropic-{j}", b'{"model": "%s", "max_tokens": %s, "messages": [{"role": "user", '
            b'"content": "hi"}]}' % (MODEL.encode(), raw), "/v1/messages")
        add(f"number-responses-{j}", b'{"model": "%s", "max_output_tokens": %s, "input": "hi"}' % (MODEL.encode(), raw),
            "/v1/responses")
    # deeply nested JSON, where it is parsed and where it is only carried
    for depth in (64, 250, 256, 300, 1000, 1023, 1100, 100_000):
        nested = b"[" * depth + b"1" + b"]" * depth
        add(f"deep-root-{depth}", nested)
        add(f"deep-field-{depth}", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "x": %s}'
            % (MODEL.encode(), nested))
        add(f"deep-stream-{depth}", b'{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "hi"}],'
            b' "max_tokens": 2, "x": %s}' % (MODEL.encode(), nested))
        add(f"deep-content-{depth}", b'{"model": "%s", "messages": [{"role": "user", "content": %s}]}'
            % (MODEL.encode(), nested))
        add(f"deep-tools-{depth}", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "tools": '
            b'[{"type": "function", "function": {"name": "f", "parameters": %s}}]}'
            % (MODEL.encode(), b'{"a":' * min(depth, 1020) + b"1" + b"}" * min(depth, 1020)))
        add(f"deep-tokenize-{depth}", b'{"model": "%s", "prompt": %s}' % (MODEL.encode(), nested), "/tokenize")
    # huge strings (the body stays under max_body_bytes)
    for size in (100_000, 1_000_000, 5_000_000):
        add(f"huge-content-{size}", _chat(messages=[{"role": "user", "content": "a" * size}]))
        add(f"huge-model-{size}", _chat(model="m" * size))
        add(f"huge-key-{size}", b'{"' + b"k" * size + b'": 1, "messages": []}')
        add(f"huge-unicode-{size}", _chat(messages=[{"role": "user", "content": "\U0001F600" * (size // 4)}]))
    # thousands of messages (limits.max_messages is 10,000)
    for count in (2_000, 10_000, 10_001, 50_000):
        add(f"messages-{count}", _chat(messages=[{"role": "user", "content": "hi"}] * count))
        add(f"anthropic-messages-{count}", {"model": MODEL, "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "hi"}] * count}, "/v1/messages")
        add(f"responses-items-{count}", {"model": MODEL, "input": [{"role": "user", "content": "hi"}] * count},
            "/v1/responses")
    # broken base64 images
    png = _png_header()
    for j, url in enumerate([
        "data:image/png;base64,@@@@not-base64@@@@", "data:image/png;base64,", "data:image/png;base64",
        "data:image/png,raw", "data:;base64,AAAA", "data:image/png;base64," + base64.b64encode(png).decode()[:-3],
        "data:image/png;base64," + base64.b64encode(png).decode(), "data:image/png;base64," + "A" * 1_000_001,
        "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff\xc0\x00\x11\x08\xff\xff\xff\xff").decode(),
        "data:image/gif;base64," + base64.b64encode(b"GIF89a\xff\xff\xff\xff").decode(),
        "data:image/webp;base64," + base64.b64encode(b"RIFF\x00\x00\x00\x00WEBPVP8X" + b"\xff" * 10).decode(),
        "data:image/png;base64," + base64.b64encode(png[:8] + b"\x00\x00\x00\x0dIHDR" + b"\xff" * 8).decode(),
        "data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(), "data:text/html,<script>",
        "data:image/png;base64,====", "data:image/png;base64,\n\r\t", "file:///etc/passwd", "", "javascript:1",
    ]):
        add(f"image-{j}", _chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": url}}]}]))
        add(f"image-anthropic-{j}", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": url.partition(",")[2]}}]}]},
            "/v1/messages")
    add("image-too-many", _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}]
        * 150}]))
    # image and video URLs pointing outside: the gateway must never fetch them (the trap listener counts connects)
    for j, url in enumerate([trap_url + "/cat.png", trap_url.replace("127.0.0.1", "localhost") + "/cat.jpg",
                             trap_url.replace("http://", "https://") + "/x.png", trap_url + "/redirect?to=/etc"]):
        add(f"outside-image-{j}", _chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}}]}]))
        add(f"outside-video-{j}", _chat(messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}}]}]))
        add(f"outside-anthropic-{j}", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": url}}]}]}, "/v1/messages")
        add(f"outside-responses-{j}", {"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}]}]}, "/v1/responses")
    # CR/LF in fields that could end up in headers (model, user, session, pool, class)
    for j, evil in enumerate(["x\r\nX-Injected: 1", "x\nSet-Cookie: a=b", "x\r\n\r\nHTTP/1.1 200 OK", "\r\n",
                              "%0d%0aX-Injected:%201"]):
        add(f"crlf-model-{j}", _chat(model=evil))
        add(f"crlf-user-{j}", _chat(user=evil))
        add(f"crlf-pool-{j}", _chat(), headers={"x-m3gate-pool": evil.replace("\r", "").replace("\n", " ")})
        add(f"crlf-session-{j}", _chat(user=evil, stream=True))
    # auth: missing, wrong, the admin key as a client key, a key with odd bytes
    for j, auth in enumerate(["", "Bearer", "Bearer wrong-key-0123456789", f"Bearer {ADMIN_KEY}", "Basic abc",
                              "Bearer " + "k" * 10_000]):
        add(f"auth-{j}", _chat(), headers={"authorization": auth})
    # methods and paths
    for method, path in (("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"), ("DELETE", "/v1/models"),
                         ("GET", "/v1/../admin/config"), ("GET", "/admin/config"), ("POST", "/admin/reload"),
                         ("GET", "/v2/chat"), ("GET", "/%00"), ("GET", "/" + "a" * 5000), ("POST", "/health"),
                         ("GET", "/admin/pools"), ("POST", "/admin/replicas/drain")):
        add(f"method-{method}-{path[:20]}", None, path, method=method)
    add("drain-unknown", {"endpoint": "http://127.0.0.1:1"}, "/admin/replicas/drain",
        headers={"authorization": f"Bearer {ADMIN_KEY}"})
    add("drain-wrong-type", {"endpoint": 5}, "/admin/replicas/drain", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    add("drain-not-json", b"{", "/admin/replicas/drain", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    # a few valid requests of every API, streamed and not, so the happy path is in the mix
    for stream in (False, True):
        add(f"valid-chat-{stream}", _chat(stream=stream))
        add(f"valid-completions-{stream}", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": stream},
            "/v1/completions")
        add(f"valid-responses-{stream}", {"model": MODEL, "input": "hi", "max_output_tokens": 4, "stream": stream},
            "/v1/responses")
        add(f"valid-messages-{stream}", {"model": MODEL, "max_tokens": 4, "stream": stream,
                                         "messages": [{"role": "user", "content": "hi"}]}, "/v1/messages")
    add("valid-tokenize", {"model": MODEL, "prompt": "hello"}, "/tokenize")
    return cases


def schemathesis_cases(count: int, seed: int = 0) -> list[Case]:
    """`count` cases generated by schemathesis from deploy/openapi.yaml: positive and negative, spread over the
    operations (generation endpoints weighted most)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    # /v1/traces takes OTLP protobuf: fuzzed as opaque bytes
    schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")
    schema = schemathesis.openapi.from_path(str(OPENAPI))
    weights = {"/v1/chat/completions": 6, "/v1/completions": 2, "/v1/responses": 2, "/v1/messages": 2,
               "/tokenize": 1, "/admin/replicas/drain": 0.5, "/admin/replicas/undrain": 0.5}
    operations = [op.ok() for op in schema.get_all_operations()]
    total_weight = sum(weights.get(op.path, 0.1) for op in operations)
    out: list[Case] = []
    for op in operations:
        share = max(3, int(count * weights.get(op.path, 0.1) / total_weight))
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            n = share // 2 if mode is schemathesis.GenerationMode.POSITIVE else share - share // 2
            drawn: list[Any] = []

            @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(op.as_strategy(generation_mode=mode))
            def collect(case: Any) -> None:
                drawn.append(case)  # noqa: B023 - collect() runs right here, in this iteration

            try:
                collect()
            except Unsatisfiable:  # e.g. no invalid variant of an operation without parameters or body
                pass
            for case in drawn[:n]:
                kwargs = case.as_transport_kwargs(base_url="")
                headers = {k: str(v) for k, v in (kwargs.get("headers") or {}).items()
                           if k.lower() not in ("user-agent", "accept-encoding", "connection", "content-length")}
                if "authorization" not in {k.lower() for k in headers} and random.Random(len(out)).random() < 0.9:
                    headers.update(AUTH)
                if "json" in kwargs:
                    body = _dumps(kwargs["json"])
                    headers.setdefault("content-type", "application/json")
                else:
                    data = kwargs.get("data")
                    body = data.encode() if isinstance(data, str) else data
                out.append(Case("schemathesis", f"{mode.value} {case.method} {case.path}", case.method.upper(),
                                case.formatted_path, body, headers, dict(kwargs.get("params") or {})))
    random.Random(seed).shuffle(out)
    return out[:count]


def mutation_cases(count: int) -> list[Case]:
    """Valid requests of each API with one field replaced by arbitrary JSON (hypothesis, derandomized)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    bases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", _chat(stream=True, chat_template_kwargs={"thinking_mode": "disabled"},
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])),
        ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "x"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])),
        ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": False}),
        ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 4}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "system": "s",
                          "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ]
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63 - 2, max_value=2**70),
        st.integers(max_value=-(2**63) + 2, min_value=-(2**70)), st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=50), st.sampled_from(["", "\x00", "\r\n", "\u202e", "\ud7ff", "🙂" * 50, "a" * 70_000,
                                               "data:image/png;base64,!!", MODEL, "user", "assistant", "image_url"]),
    )
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)

    def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        found = [prefix] if prefix else []
        if isinstance(obj, dict):
            for k, v in obj.items():
                found += paths(v, (*prefix, k))
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                found += paths(v, (*prefix, i))
        return found

    def put(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
        obj = json.loads(json.dumps(obj))
        target = obj
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return obj

    drawn: list[Case] = []

    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate], derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(bases) - 1), st.integers(0, 10_000), values, st.booleans(), st.text(max_size=8))
    def collect(base_i: int, path_i: int, value: Any, new_key: bool, key: str) -> None:
        path, base = bases[base_i]
        if new_key:
            body = {**base, key: value}
        else:
            candidates = paths(base)
            body = put(base, candidates[path_i % len(candidates)], value)
        drawn.append(Case("mutation", f"{path} {'+' + key if new_key else 'field'}", "POST", path, _dumps(body),
                          {**AUTH, "content-type": "application/json"}))

    collect()
    return drawn[:count]


def send_cases(url: str, cases: Sequence[Case], tally: Tally, workers: int = 4, timeout: float = 30.0) -> None:
    local = threading.local()

    def client() -> httpx.Client:
        c = getattr(local, "client", None)
        if c is None:
            c = local.client = httpx.Client(base_url=url, timeout=timeout)
        return c

    def one(case: Case) -> None:
        try:
            resp = client().request(case.method, case.path, content=case.body, headers=case.headers,
                                    params=case.params or None)
        except (httpx.LocalProtocolError, httpx.InvalidURL, UnicodeError, ValueError, TypeError):
            with tally._lock:
                tally.not_sent += 1
            return
        except httpx.HTTPError as exc:
            local.client = None  # the connection is gone: a fresh client for the next case
            tally.check(case.source, f"{case.label} ({type(exc).__name__})", None, None, b"", case.body)
            return
        tally.check(case.source, case.label, resp.status_code, resp.headers, resp.content, case.body)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, cases))


# -- connection-level attacks ----------------------------------------------------------------------------------------


class Trap:
    """A loopback listener that records every connection made to it, and which process made it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                continue
            self.connections.append(f"{peer[0]}:{peer[1]} from pid {_pid_of_port(peer[1])}")
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


def _pid_of_port(port: int) -> int | None:
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port:
                return c.pid
    except Exception:  # noqa: BLE001 - attribution is best effort
        pass
    return None


def _raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:
            pass
        return _read_all(s, timeout)


def _trickle(sock: socket.socket, piece: bytes, give_up_s: float) -> tuple[bytes, float]:
    """Send `piece` every 0.25 s (a slowloris client) until the server answers or closes, or `give_up_s` passes;
    returns (what it answered, seconds taken)."""
    t0 = time.monotonic()
    answered = b""
    sock.settimeout(0.25)
    while time.monotonic() - t0 < give_up_s:
        try:
            sock.sendall(piece)
            answered = sock.recv(4096)
            if answered:
                break
        except TimeoutError:
            continue
        except OSError:
            break
    return answered, time.monotonic() - t0


def _read_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out and _complete(out):
                break
    except OSError:
        pass
    return out


def _complete(resp: bytes) -> bool:
    head, _, body = resp.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":", 1)[1])
    return False


def _status(resp: bytes) -> int | None:
    try:
        return int(resp.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None


def _body(resp: bytes) -> bytes:
    return resp.partition(b"\r\n\r\n")[2]


@dataclass
class Attack:
    name: str
    ok: bool
    detail: str


def attacks(target: Target, body_timeout_s: float, idle_connections: int) -> list[Attack]:
    port = target.gateway.port
    results: list[Attack] = []
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {CLIENT_KEY}\r\n"
            "Content-Type: application/json\r\n")

    def record(name: str, ok: bool, detail: str) -> None:
        results.append(Attack(name, ok, detail))

    # 10 MB: a valid body far over every pool's context → a 4xx after classification
    big = _dumps(_chat(messages=[{"role": "user", "content": "word " * 2_000_000}]))
    resp = httpx.post(target.url + "/v1/chat/completions", content=big, headers={**AUTH}, timeout=60)
    record("10 MB body", 400 <= resp.status_code < 500 and openai_error_shape(resp.content),
           f"{len(big) / 1e6:.0f} MB → {resp.status_code} {resp.text[:100]}")
    # 200 MB declared: refused from the Content-Length alone, before reading it
    size = 200 * 1024 * 1024
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((head + f"Content-Length: {size}\r\n\r\n").encode())
        sent = 0
        chunk = b"a" * (1 << 20)
        s.settimeout(0.5)
        try:
            while sent < 8 * len(chunk):  # a little of it; the answer comes first
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        resp_raw = _read_all(s, 10)
    record("200 MB body (Content-Length)", _status(resp_raw) == 413 and openai_error_shape(_body(resp_raw)),
           f"→ {_status(resp_raw)} after {sent >> 20} MB sent")
    # 200 MB chunked, no Content-Length: refused once max_body_bytes is passed
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
        piece = b"a" * (1 << 20)
        frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        sent = 0
        try:
            while sent < size:
                s.sendall(frame)
                sent += len(piece)
        except OSError:
            pass
        resp_raw = _read_all(s, 10)
    record("200 MB body (chunked)", _status(resp_raw) == 413 and openai_error_shape(_body(resp_raw)),
           f"→ {_status(resp_raw)} after {sent >> 20} MB sent")
    # slowloris body: declared 1000 bytes, one byte every 0.25 s → 408 at body_read_timeout_s
    for path in ("/v1/chat/completions", "/tokenize"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(head.replace("/v1/chat/completions", path).encode() + b"Content-Length: 1000\r\n\r\n")
            answered, elapsed = _trickle(s, b" ", body_timeout_s + 5)
        record(f"slowloris body {path}", _status(answered) == 408 and elapsed < body_timeout_s + 2,
               f"→ {_status(answered)} after {elapsed:.1f} s")
    # slowloris headers: a header line every 0.25 s, never finished → 408 and closed at the head deadline
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        answered, elapsed = _trickle(s, b"x-slow: 1\r\n", body_timeout_s + 5)
    record("slowloris headers", _status(answered) == 408 and elapsed < body_timeout_s + 2,
           f"→ {_status(answered)} after {elapsed:.1f} s")
    # many connections that never send: the gateway keeps serving meanwhile, then closes them at the deadline
    socks: list[socket.socket] = []
    fds_before = target.fds()
    try:
        for _ in range(idle_connections):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        t0 = time.monotonic()
        resp = httpx.post(target.url + "/v1/chat/completions", json=_chat(), headers=AUTH, timeout=30)
        serve_s = time.monotonic() - t0
        fds_open = target.fds()
        closed = 0
        deadline = time.monotonic() + body_timeout_s + 5
        for s in socks:
            s.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                data = s.recv(4096)
                closed += _status(data) == 408 or data == b""
            except OSError:
                pass
    finally:
        for s in socks:
            s.close()
    time.sleep(0.5)
    record(f"{idle_connections} connections that never send",
           resp.status_code == 200 and serve_s < 5 and closed == len(socks),
           f"a request meanwhile: {resp.status_code} in {serve_s:.2f} s; gateway fds {fds_before} → {fds_open} → "
           f"{target.fds()}; {closed}/{len(socks)} closed by the gateway (408) within the head deadline")
    # CR/LF and other raw-header tricks: refused by the HTTP layer with an OpenAI-shaped 400, never relayed
    for name, raw in [
        ("bare CR in a header", head.encode() + b"X-Evil: a\rX-Injected: 1\r\nContent-Length: 2\r\n\r\n{}"),
        ("bare LF in a header", head.encode() + b"X-Evil: a\nX-Injected: 1\r\nContent-Length: 2\r\n\r\n{}"),
        ("obs-fold header", head.encode() + b"X-Evil: a\r\n X-Injected: 1\r\nContent-Length: 2\r\n\r\n{}"),
        ("NUL in a header", head.encode() + b"X-Evil: a\x00b\r\nContent-Length: 2\r\n\r\n{}"),
        ("two Content-Lengths", head.encode() + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}"),
        ("CL and TE", head.encode() + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        ("space before colon", head.encode() + b"Content-Length : 2\r\n\r\n{}"),
        ("garbage request line", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64),
        ("huge header", head.encode() + b"X-Big: " + b"a" * 100_000 + b"\r\nContent-Length: 2\r\n\r\n{}"),
    ]:
        resp_raw = _raw(port, raw, timeout=5)
        status = _status(resp_raw)
        headers_part = resp_raw.partition(b"\r\n\r\n")[0].lower()
        ok = (status is not None and 400 <= status < 500 and openai_error_shape(_body(resp_raw))
              and b"x-injected" not in headers_part)
        record(f"raw: {name}", ok, f"→ {status} {_body(resp_raw)[:90]!r}")
    return results


# -- the run -----------------------------------------------------------------------------------------------------------


@dataclass
class Report:
    cases: int
    by_source: dict[str, int]
    by_status: dict[str, int]
    gateway_5xx: int
    gateway_5xx_codes: dict[str, int]
    relayed_5xx: int
    bad_error_shape: int
    no_answer: int
    not_sent: int
    outbound_connections: list[str]
    attacks: list[dict[str, Any]]
    rss_cold_mb: float
    rss_baseline_mb: float
    rss_trajectory_mb: list[float]
    rss_peak_mb: float
    rss_after_mb: float
    fds_baseline: int
    fds_after: int
    gateway_alive: bool
    tracebacks: int
    seconds: float
    examples: list[str]

    @property
    def gateway_own_5xx(self) -> int:
        """5xx that are the gateway's own failures, not its report of a replica's (upstream_* codes)."""
        return sum(n for key, n in self.gateway_5xx_codes.items()
                   if not key.split(" ", 1)[1].startswith(("upstream_", "no_healthy_replica")))

    @property
    def rss_growth(self) -> float:
        return (self.rss_after_mb - self.rss_baseline_mb) / self.rss_baseline_mb

    @property
    def passed(self) -> bool:
        return (self.gateway_own_5xx == 0 and self.gateway_5xx - self.gateway_own_5xx <= max(2, self.cases // 1000)
                and self.bad_error_shape == 0 and self.no_answer == 0
                and not self.outbound_connections and all(a["ok"] for a in self.attacks) and self.gateway_alive
                and self.tracebacks == 0 and self.rss_growth <= RSS_TOLERANCE
                and self.fds_after <= self.fds_baseline + 8)


RSS_TOLERANCE = 0.10  # "back to baseline": within 10% of the warmed-up RSS


def run_fuzz(total: int = 10_000, idle_connections: int = 1000, body_timeout_s: float = 2.0, workers: int = 4,
             log: Callable[[str], None] = print) -> Report:
    started = time.monotonic()
    trap = Trap()
    try:
        with fuzz_target(body_timeout_s) as target:
            tally = Tally()
            hand = corpus(trap.url)
            remaining = max(0, total - len(hand))
            log(f"fuzz: generating {remaining} cases (schemathesis from {OPENAPI.name}, hypothesis mutations)")
            generated = schemathesis_cases(remaining // 2) if remaining else []  # ~30 ms a case to generate
            generated += mutation_cases(remaining - len(generated)) if remaining > len(generated) else []
            # warm up (imports, caches, connection pools, the allocator's working set: valid traffic and one pass
            # of the corpus, not tallied), then the baseline
            send_cases(target.url, hand[-9:] * 20, Tally(), workers)
            time.sleep(1.0)
            rss_cold = target.rss()
            send_cases(target.url, hand, Tally(), workers)
            send_cases(target.url, hand[-9:] * 20, Tally(), workers)
            time.sleep(1.0)
            rss0, fds0 = target.rss(), target.fds()
            trajectory = [round(rss0 / 1e6, 1)]
            log(f"fuzz: RSS {rss_cold / 1e6:.1f} MB cold, baseline {rss0 / 1e6:.1f} MB warm, {fds0} fds; sending "
                f"{len(hand)} corpus cases")
            send_cases(target.url, hand, tally, workers)
            trajectory.append(round(target.rss() / 1e6, 1))
            log(f"fuzz: {len(generated)} generated cases")
            for i in range(0, len(generated), 1000):
                send_cases(target.url, generated[i:i + 1000], tally, workers)
                trajectory.append(round(target.rss() / 1e6, 1))
            peak = max(trajectory) * 1e6
            log("fuzz: connection-level attacks")
            attack_results = attacks(target, body_timeout_s, idle_connections)
            peak = max(peak, target.rss())
            time.sleep(2.0)  # answers sent, connections closed: let the gateway settle
            send_cases(target.url, hand[-9:] * 20, Tally(), workers)  # same warm traffic as before the baseline
            # idle upstream connections close after aiohttp's 15 s keep-alive: wait for that (bounded)
            idle_until = time.monotonic() + 20
            while time.monotonic() < idle_until and target.fds() > fds0 + 2:
                time.sleep(0.5)
            rss1, fds1 = target.rss(), target.fds()
            alive = target.gateway.alive()
            log_text = target.gateway.log_path.read_text(errors="replace")
            tracebacks = log_text.count("Traceback (most recent call last)")
    finally:
        trap.close()
    gc.collect()
    return Report(
        cases=tally.cases, by_source=dict(tally.by_source), by_status={str(k): v for k, v in
                                                                       sorted(tally.by_status.items())},
        gateway_5xx=tally.gateway_5xx, gateway_5xx_codes=dict(tally.gateway_5xx_codes), relayed_5xx=tally.relayed_5xx,
        bad_error_shape=tally.bad_error_shape,
        no_answer=tally.no_answer, not_sent=tally.not_sent, outbound_connections=trap.connections,
        attacks=[asdict(a) for a in attack_results], rss_cold_mb=round(rss_cold / 1e6, 1),
        rss_baseline_mb=round(rss0 / 1e6, 1), rss_trajectory_mb=trajectory,
        rss_peak_mb=round(peak / 1e6, 1), rss_after_mb=round(rss1 / 1e6, 1), fds_baseline=fds0, fds_after=fds1,
        gateway_alive=alive, tracebacks=tracebacks, seconds=round(time.monotonic() - started, 1),
        examples=tally.examples)


def summary(report: Report) -> str:
    lines = [
        "| figure | value | target |",
        "|---|---:|---|",
        f"| cases (HTTP exchanges) | {report.cases:,} | — |",
        f"| by source | {', '.join(f'{k} {v:,}' for k, v in sorted(report.by_source.items()))} | — |",
        f"| 5xx from the gateway itself (its own failures: server_error) | {report.gateway_own_5xx} | 0 |",
        f"| 5xx the gateway made of replica trouble (502/503/504 upstream_*) | "
        f"{report.gateway_5xx - report.gateway_own_5xx} {dict(report.gateway_5xx_codes) if report.gateway_5xx else ''}"
        f" | ≤ 0.1 % of cases |",
        f"| 5xx relayed from a replica | {report.relayed_5xx} | (replica's) |",
        f"| 4xx not in OpenAI's error shape | {report.bad_error_shape} | 0 |",
        f"| connections dropped without an answer | {report.no_answer} | 0 |",
        f"| gateway process alive at the end / tracebacks in its log | {report.gateway_alive} / "
        f"{report.tracebacks} | yes / 0 |",
        f"| outbound connections to the trap URL | {len(report.outbound_connections)} | 0 |",
        f"| RSS cold → warmed-up baseline → peak → after | {report.rss_cold_mb} → {report.rss_baseline_mb} → "
        f"{report.rss_peak_mb} → {report.rss_after_mb} MB ({report.rss_growth:+.1%}) | after within "
        f"{RSS_TOLERANCE:.0%} of baseline |",
        f"| RSS after each batch (corpus, then 1,000 generated cases each) | "
        f"{' → '.join(str(x) for x in report.rss_trajectory_mb)} MB | a plateau |",
        f"| open fds baseline → after | {report.fds_baseline} → {report.fds_after} | no growth |",
        f"| statuses | {', '.join(f'{k}: {v:,}' for k, v in report.by_status.items())} | — |",
    ]
    lines += ["", "| attack | result | detail |", "|---|---|---|"]
    lines += [f"| {a['name']} | {'pass' if a['ok'] else 'FAIL'} | {a['detail']} |" for a in report.attacks]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.robustness.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--idle-connections", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` blocks stop the processes started here
    report = run_fuzz(args.cases, args.idle_connections, log=lambda line: print(line, flush=True))
    md = summary(report)
    print()
    print(md)
    for example in report.examples:
        print(f"- {example}")
    print(f"\n{report.cases:,} cases in {report.seconds:.0f} s: {'PASS' if report.passed else 'FAIL'}")
    print(f"results: {write_results(args.out, 'fuzz', asdict(report), md)}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
