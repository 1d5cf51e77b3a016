"""Assembly: the ASGI app of one gateway. Nothing here decides anything.

`build_app` wires a `Gateway` (gateway/runtime.py: state and lifecycle), its `Coordinator` (gateway/coordinator.py:
one request's path), the config reloader and the routes (gateway/routes.py for clients, gateway/admin.py for
operators) into a Starlette app whose generate endpoints skip Starlette's middleware and router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.admin import admin_routes
from gateway.batch import BatchRunner, batch_routes
from gateway.coordinator import Coordinator
from gateway.errors import error_response
from gateway.observability.history import History
from gateway.reload import ConfigReloader
from gateway.routes import generate_endpoints, routes
from gateway.runtime import Gateway
from gateway.ui import ui_routes
from policies.config import GatewayConfig

log = logging.getLogger("m3gate")


def build_app(config: GatewayConfig, config_path: str | None = None, resolver: Any = None,
              supervisor_pid: int | None = None) -> Starlette:
    """The ASGI app; with `config_path` the file is watched and reloadable (SIGHUP, /admin/reload).
    `supervisor_pid`: this is a worker of that supervisor (gateway/supervisor.py), which /admin/reload asks to
    reload every worker."""
    gateway = Gateway(config, resolver=resolver)
    coordinator = Coordinator(gateway)
    reloader = ConfigReloader(gateway, config_path)
    history = History(gateway)  # the status page's chart points, sampled while the app runs
    batch = BatchRunner(gateway, coordinator) if config.batch.enabled else None  # the Batch API's jobs

    @asynccontextmanager
    async def lifespan(app: Starlette):  # type: ignore[no-untyped-def]
        await gateway.start()
        coordinator.stalls.start()
        history.start()
        if batch is not None:
            await batch.start()
        if config_path and config.admin.watch_config:
            reloader.start_watching()
        if config_path:
            _on_sighup(lambda: asyncio.ensure_future(reloader.reload("SIGHUP")))
        try:
            yield
        finally:
            if batch is not None:
                await batch.stop()
            await history.stop()
            await coordinator.stalls.stop()
            await reloader.stop()
            await gateway.stop()

    extra = batch_routes() if batch is not None else []
    app = GatewayApp(generate_endpoints(coordinator), routes=[*routes(), *admin_routes(), *ui_routes(), *extra],
                     lifespan=lifespan, exception_handlers=_exception_handlers())
    app.state.gateway = gateway
    app.state.coordinator = coordinator
    app.state.reloader = reloader
    app.state.history = history
    app.state.batch = batch
    app.state.supervisor_pid = supervisor_pid
    return app


class GatewayApp(Starlette):
    """Starlette, except that POSTs to the generate paths go straight to their endpoints (`fast_routes`), ahead of
    the middleware stack and router: the hot path pays for neither. Everything else is plain Starlette."""

    def __init__(self, fast_routes: Mapping[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes = dict(fast_routes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.fast_routes.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _on_sighup(callback: Any) -> None:
    import signal

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, callback)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        pass


def _exception_handlers() -> dict[Any, Any]:
    """Even the gateway's own surprises and unknown paths answer in OpenAI's error shape."""
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, message, type_, code=exc.status_code)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "The gateway failed on this request; it has been logged.", "server_error",
                                      code="internal_error")

    return {HTTPException: http_error, Exception: internal_error}
