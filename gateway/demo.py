"""`m3gate demo`: three simulated pools and the gateway in one command, on loopback, with in-memory state.

The pools are `m3gate sim` processes sized like the product's 32K interactive, 128K repository and 1M extended pools.
Ctrl-C (or SIGTERM) stops the gateway and every simulator it started.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from typing import Any

import uvicorn

from gateway.app import build_app
from policies.config import GatewayConfig

MODEL = "MiniMaxAI/MiniMax-M3"
DEMO_POOLS: list[dict[str, Any]] = [
    {"name": "interactive", "max_model_len": 32768, "modalities": ["text", "image", "video"],
     "sim_args": ["--modalities", "text,image,video", "--kv-blocks", "4096"]},
    {"name": "repository", "max_model_len": 131072, "modalities": ["text"], "sim_args": ["--kv-blocks", "8192"]},
    {"name": "extended", "max_model_len": 1048576, "modalities": ["text"], "sim_args": ["--kv-blocks", "16384"]},
]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def demo_config(endpoints: dict[str, list[str]], port: int) -> GatewayConfig:
    return GatewayConfig.model_validate(
        {
            "model": MODEL,
            "aliases": ["minimax-m3"],
            "pools": [
                {"name": p["name"], "max_model_len": p["max_model_len"], "modalities": p["modalities"],
                 "endpoints": endpoints[p["name"]]}
                for p in DEMO_POOLS
            ],
            "server": {"host": "127.0.0.1", "port": port},
        }
    )


def snippet(base_url: str) -> str:
    return f"""
m3gate demo is up: {base_url}   (three simulated pools: 32K interactive, 128K repository, 1M extended)

    from openai import OpenAI
    client = OpenAI(base_url="{base_url}", api_key="unused")
    r = client.chat.completions.create(
        model="{MODEL}",
        messages=[{{"role": "user", "content": "Hello!"}}],
        max_tokens=32,
    )
    print(r.choices[0].message.content)

    curl -s {base_url}/chat/completions -H 'content-type: application/json' \\
      -d '{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":8}}' -i

Status page (live: pools, replicas, classes, latency, the latest requests' stages):
    {base_url[:-3]}/ui

Every response carries x-m3gate-pool and x-m3gate-endpoint. Ctrl-C stops everything.
"""


def run_demo(port: int = 8080) -> int:
    from pools.sim.launcher import start_sim

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _port_free(port):
        print(f"port {port} is taken; run `m3gate demo --port N`", file=sys.stderr)
        return 2
    sims = []
    try:
        for pool in DEMO_POOLS:
            sims.append(start_sim(pool["max_model_len"], model=MODEL, extra_args=pool["sim_args"]))
        endpoints = {pool["name"]: [sim.url] for pool, sim in zip(DEMO_POOLS, sims, strict=True)}
        config = demo_config(endpoints, port)
        base_url = f"http://127.0.0.1:{port}/v1"
        for pool, sim in zip(DEMO_POOLS, sims, strict=True):
            print(f"  pool {pool['name']:<12} {pool['max_model_len']:>8} tokens  simulator pid {sim.pid} at {sim.url}")
        print(snippet(base_url), flush=True)
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        uvicorn.run(build_app(config), host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                    log_level="warning", access_log=False)
    except KeyboardInterrupt:
        pass
    finally:
        for sim in sims:
            sim.stop()
        print("m3gate demo stopped (gateway and simulators).", flush=True)
    return 0
