"""`m3gate serve`: load the config, build the app, run it under uvicorn (uvloop + httptools; the default) or granian
(`server.listener: granian`, or M3GATE_LISTENER=granian)."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import sys

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.app import build_app
from gateway.errors import REFUSAL_HEADER, error_body
from gateway.supervisor import prepare_worker, supervise, worker_sockets
from policies.config import ConfigError, GatewayConfig, load_config


def load_app(config_path: str) -> tuple[GatewayConfig, Starlette] | None:
    """What both front doors (`m3gate serve`, `m3gate epp`) start from: logging, the config (None, its error
    printed, when it is invalid) and the app, with the process's memory settings for a long-running gateway."""
    config = _load_config(config_path)
    return None if config is None else (config, _build_app(config, config_path))


def _build_app(config: GatewayConfig, config_path: str, supervisor_pid: int | None = None) -> Starlette:
    _return_freed_memory()
    app = build_app(config, config_path, supervisor_pid=supervisor_pid)
    _quiet_garbage_collector()
    return app


def _load_config(config_path: str, worker: int | None = None) -> GatewayConfig | None:
    where = "" if worker is None else f"worker {worker} "
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s")
    try:
        return load_config(config_path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None


def serve(config_path: str, host: str | None = None, port: int | None = None, worker: int | None = None) -> int:
    """One gateway process; with server.workers > 1 the supervisor of that many (gateway/supervisor.py), each of
    them this again with `worker` set: the same start-up (memory settings, app, protocol) on a shared port."""
    if worker is not None:
        prepare_worker()
    config = _load_config(config_path, worker)
    if config is None:
        return 2
    host = host or config.server.host
    port = port if port is not None else config.server.port
    listener = os.environ.get("M3GATE_LISTENER") or config.server.listener
    if listener not in ("uvicorn", "granian"):
        print(f"unknown listener {listener!r} (uvicorn or granian)", file=sys.stderr)
        return 2
    if worker is None and config.server.workers > 1:
        if listener != "uvicorn":
            print("server.workers > 1 runs uvicorn workers; M3GATE_LISTENER=granian is single-process",
                  file=sys.stderr)
            return 2
        return supervise(config, config_path, host, port)
    app = _build_app(config, config_path, os.getppid() if worker is not None else None)
    if config.admin.api_key is None and not worker:
        logging.getLogger("m3gate").warning("no admin.api_key: the admin API answers loopback clients only")
    if listener == "granian":
        serve_granian(app, host, port, config.limits.body_read_timeout_s)
        return 0
    server = uvicorn.Server(uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=type("GatewayHttpProtocol", (GatewayHttpProtocol,),
                  {"head_timeout_s": config.limits.body_read_timeout_s}),
        log_level="warning",
        access_log=False,
        timeout_keep_alive=30,
    ))
    sockets = None
    if worker is not None:
        try:
            sockets = list(worker_sockets(host, port, worker, config.server.worker_port_base))
        except OSError as exc:
            print(f"worker {worker}: cannot listen: {exc.strerror or exc}", file=sys.stderr)
            return 2
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it drained on: the stop asked for (as uvicorn.run)
        pass
    return 0 if server.started else 3  # 3: the app's startup failed (uvicorn.run's exit status)


def serve_granian(app: object, host: str, port: int, head_timeout_s: float) -> None:
    """The app under granian's ASGI interface, embedded in this process on uvloop: one process (its Rust I/O
    threads beside the Python loop), like uvicorn's single worker, with the same lifespan (startup, SIGHUP reload,
    graceful shutdown on SIGTERM / SIGINT: granian stops accepting, lets requests in flight finish, then the
    lifespan's shutdown runs). Limits: a request head must arrive within `head_timeout_s` (granian's
    header_read_timeout, at most 60 s; hyper closes the connection without an answer where uvicorn's hardened
    protocol sends a 408), a head larger than granian's HTTP/1 buffer (417,792 bytes) is refused by hyper itself
    (smaller ones reach the app's own 431 check), and malformed requests get hyper's empty 400 rather than the
    OpenAI-shaped one. Measured against uvicorn in docs/performance.md, "Reference proxies and listeners": an opt-in,
    not the default."""
    import signal

    import uvloop
    from granian.constants import HTTPModes, Interfaces
    from granian.http import HTTP1Settings
    from granian.log import LogLevels
    from granian.server.embed import Server

    server = Server(app, address=host, port=port, interface=Interfaces.ASGI, http=HTTPModes.http1, websockets=False,
                    backlog=2048, log_level=LogLevels.warning,
                    http1_settings=HTTP1Settings(header_read_timeout=int(min(60.0, head_timeout_s) * 1000)))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.signal_handler_interrupt)
        await server.serve()

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(run())


def _return_freed_memory() -> None:
    """Pin glibc's mmap and trim thresholds at 8 MiB. By default glibc raises its mmap threshold to the size of each
    large buffer freed (up to 32 MiB, the trim threshold to twice that), so after one big body later ones came from
    the heap and up to 64 MiB stayed resident for good: the fuzz suite saw the RSS end 23 % above its baseline after
    10,000 cases with ~1 MB more live Python objects. Pinned lower (128 KiB) every long prompt's body and its copies
    got fresh mappings instead, each page faulted in and zeroed by the kernel on first touch and unmapped when freed:
    half of the gateway's CPU on a 95K-token request was that system time (3.75 of 7.5 ms). At 8 MiB a body up to
    ~2M tokens is served from the heap, larger ones (hostile uploads) get their own mappings, and the heap gives back
    free space beyond 8 MiB (fuzz suite: RSS after within 3 % of baseline; docs/performance.md). No effect elsewhere
    than glibc, or when MALLOC_*_ variables are set."""
    if any(name.startswith("MALLOC_") for name in os.environ):
        return
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 8 * 1024 * 1024)
    mallopt(m_trim_threshold, 8 * 1024 * 1024)


def _quiet_garbage_collector() -> None:
    """Move everything loaded at start (modules, config, tokenizer tables) out of the collector's sight and make
    young-generation passes rarer. A request allocates a few hundred objects, almost none in reference cycles, so
    with the default threshold (700) the collector ran every couple of requests and rescanned start-up objects in
    its older generations; the young generation still runs often enough to bound cyclic garbage."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(7000, 20, 20)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, hardened against hostile clients.

    - A request head (request line and headers) must arrive within `head_timeout_s` (limits.body_read_timeout_s,
      read at start) of the connection opening, or of the request's first byte on a kept-alive connection; else
      the client gets a 408 and the connection is closed. uvicorn alone waits forever, so connections that never
      send, or send their headers a byte at a time (slowloris), would each hold a socket for good.
    - A request that cannot be parsed gets an OpenAI-shaped JSON 400 instead of uvicorn's plain text.
    """

    head_timeout_s: float = 30.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._send_error(400, "Bad Request", f"Malformed HTTP request: {msg}", "invalid_http_request")

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a pipelined head behind a response still being sent: that response's own timeouts apply
        self._send_error(408, "Request Timeout", f"The request headers did not arrive within {self.head_timeout_s:g} "
                         "s.", "request_timeout")

    def _send_error(self, status: int, reason: str, message: str, code: str) -> None:
        body = error_body(message, "invalid_request_error", None, code)
        self.transport.write(
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{REFUSAL_HEADER}: {code}\r\nconnection: close\r\n\r\n".encode() + body
        )
        self.transport.close()
