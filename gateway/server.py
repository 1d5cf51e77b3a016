"""`m3gate serve`: load the config, build the app, run uvicorn (uvloop + httptools)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from gateway.app import build_app
from pools.config import ConfigError, load_config


def serve(config_path: str, host: str | None = None, port: int | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    app = build_app(config, config_path)
    if config.admin.api_key is None:
        logging.getLogger("m3gate").warning("no admin.api_key: the admin API answers loopback clients only")
    uvicorn.run(
        app,
        host=host or config.server.host,
        port=port if port is not None else config.server.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=30,
    )
    return 0
