"""`m3gate epp`: the endpoint picker's process. One event loop serves both doors' needs: the ext_proc gRPC service
(gateway/epp/picker.py) with the gRPC health services the Gateway API Inference Extension names (`liveness`,
`readiness`, `envoy.service.ext_proc.v3.ExternalProcessor`) on `port`, and on `http_port` the gateway's own HTTP app,
exactly as `m3gate serve` builds it (/metrics, the status page /ui, /admin/*, /health, and the OpenAI endpoints
themselves)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import uvicorn
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.epp.picker import EndpointPicker
from gateway.runtime import Gateway
from gateway.server import GatewayHttpProtocol, load_app

log = logging.getLogger("m3gate.epp")

HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
_MESSAGE_BYTES = 128 * 1024 * 1024  # a body chunk per message; Envoy's are far smaller, but never refuse one


def run_epp(config_path: str, host: str = "0.0.0.0", port: int = 9002, http_port: int = 9003,
            response_processing: str = "full") -> int:
    loaded = load_app(config_path)
    if loaded is None:
        return 2
    config, app = loaded
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        pass
    http = uvicorn.Server(uvicorn.Config(
        app, host=host, port=http_port, log_level="warning", access_log=False, timeout_keep_alive=30,
        http=type("GatewayHttpProtocol", (GatewayHttpProtocol,), {"head_timeout_s": config.limits.body_read_timeout_s}),
    ))
    asyncio.run(_serve(http, app, host, port, response_processing))
    return 0


async def _serve(http: uvicorn.Server, app: Any, host: str, port: int, response_processing: str) -> None:
    """The HTTP app first (its lifespan starts the gateway: replicas' health, state), then the gRPC side; both stop
    when the HTTP server does (SIGTERM / SIGINT)."""
    http_task = asyncio.ensure_future(http.serve())
    while not http.started:
        if http_task.done():
            return await http_task
        await asyncio.sleep(0.02)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", _MESSAGE_BYTES)])
    picker = EndpointPicker(app.state.coordinator, app, response_processing)
    ext_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    server.add_insecure_port(address)
    await server.start()
    log.info("endpoint picker on %s (ext_proc, response processing: %s); HTTP on port %s", address,
             response_processing, http.config.port)
    watch = asyncio.ensure_future(_health(servicer, app.state.gateway))
    try:
        await http_task
    finally:
        watch.cancel()
        await servicer.enter_graceful_shutdown()
        await server.stop(grace=5)


async def _health(servicer: Any, gw: Gateway) -> None:
    """`liveness` while the process runs; `readiness` and the ext_proc service while some pool has a replica up."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    await servicer.set("liveness", serving)
    await servicer.set("", serving)
    while True:
        now = gw.clock()
        ready = any(pool.available(now) for pool in gw.pools.values())
        for name in HEALTH_SERVICES[1:]:
            await servicer.set(name, serving if ready else not_serving)
        await asyncio.sleep(1.0)
