"""Runs a `SimApp` under uvicorn (uvloop + httptools, like vLLM's own server) on a socket it can close and reopen.

The socket is ours rather than uvicorn's so that `--port 0` can report the port it got (no race between test
processes picking "free" ports) and so the `refuse_connections` fault can really stop listening: clients then get
ECONNREFUSED, exactly as from a replica that died, while connections already open keep being served.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import sys
from types import FrameType

import uvicorn

from pools.sim.app import QuietDrops, SimApp
from pools.sim.settings import SimSettings

READY_PREFIX = "m3gate-sim listening on "


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class SocketListener:
    """pause(): stop accepting (close the listening socket); resume(): listen again on the same port."""

    def __init__(self, server: uvicorn.Server, host: str, port: int) -> None:
        self._server = server
        self._host = host
        self._port = port
        self._paused = False

    def pause(self) -> None:
        if self._paused:
            return
        self._paused = True
        for srv in self._server.servers:
            srv.close()

    def resume(self) -> None:
        if not self._paused:
            return
        self._paused = False
        sock = bind_socket(self._host, self._port)  # listening now: connections queue until accepted
        config = self._server.config
        create_protocol = functools.partial(config.http_protocol_class, config=config,
                                            server_state=self._server.server_state,
                                            app_state=self._server.lifespan.state)
        loop = asyncio.get_running_loop()

        async def reopen() -> None:
            srv = await loop.create_server(create_protocol, sock=sock, backlog=config.backlog)
            self._server.servers.append(srv)

        loop.create_task(reopen())


class DrainingServer(uvicorn.Server):
    """SIGTERM starts vLLM's shutdown (`SimApp.drain`, bounded by --shutdown-timeout) and exits when it is done;
    SIGINT stops at once as before."""

    def __init__(self, config: uvicorn.Config, app: SimApp, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._app = app
        self._shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None:
            super().handle_exit(sig, frame)
            return
        if not self._draining:
            self._draining = True
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))  # type: ignore[union-attr]

    async def _drain(self) -> None:
        await self._app.drain(self._shutdown_timeout)
        await asyncio.sleep(0.05)  # let the streams write their last chunks
        self.config.timeout_graceful_shutdown = None  # as vLLM: wait for every open connection to be closed
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)


def serve(settings: SimSettings) -> int:
    """Run until SIGTERM/SIGINT. Prints one line `m3gate-sim listening on http://HOST:PORT` once it accepts."""
    logging.getLogger("uvicorn.error").addFilter(QuietDrops())
    app = SimApp(settings)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        print(f"m3gate sim: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    if app.kv_connector is not None:
        app.kv_connector.port = port  # remote_port: where decode replicas reach this one's /sim/kv routes
    config = uvicorn.Config(app, loop="uvloop", http="httptools", lifespan="on", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=1, timeout_keep_alive=5)
    server = DrainingServer(config, app, settings.shutdown_timeout)

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.005)
        if server.started:
            app.listener = SocketListener(server, settings.host, port)
            app.apply_start_faults()
            host = f"[{settings.host}]" if ":" in settings.host else settings.host
            print(f"{READY_PREFIX}http://{host}:{port}", flush=True)
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the ready line is all stdout carries
        await task

    import uvloop

    uvloop.run(main())
    return 0 if server.started else 1
