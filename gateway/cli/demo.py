"""`m3gate demo`: three simulated pools and the gateway in one command, on loopback, with in-memory state.

The pools are `m3gate sim` processes sized like the product's 32K interactive, 128K repository and 1M extended pools.
Unless `--no-traffic`, the demo also sends its own light sample workload to the gateway (gateway/cli/demo_workload.py)
so that the status page is alive on first open. Ctrl-C (or SIGTERM) stops the traffic, the gateway and every
simulator it started.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from typing import Any

import uvicorn
import uvloop

from gateway.app import build_app
from gateway.cli.demo_workload import DemoTraffic
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
            # the deployment guide's three classes, with TPOT targets too so the page has both lines to hold
            "traffic": {"classes": {
                "interactive": {"priority": 0, "max_concurrency": 256, "queue_length": 512, "max_queue_wait_s": 10,
                                "targets": {"ttft_ms": {"p95": 1000}, "tpot_ms": {"p95": 50}}},
                "repository": {"priority": 1, "max_concurrency": 32, "queue_length": 256, "max_queue_wait_s": 60,
                               "targets": {"ttft_ms": {"p95": 10000}, "tpot_ms": {"p95": 50}}},
                "extended": {"priority": 2, "max_concurrency": 8, "queue_length": 64, "max_queue_wait_s": 120,
                             "targets": {"ttft_ms": {"p95": 60000}, "tpot_ms": {"p95": 80}}},
            }},
        }
    )


TRAFFIC_ON = ("Sample traffic: ON, a couple of requests a second of the demo's own (chats, a reasoning stream, an "
              "agent session,\n    a repository-size prompt, a long document now and then); "
              "`m3gate demo --no-traffic` for a quiet gateway.")
TRAFFIC_OFF = "Sample traffic: OFF (--no-traffic): the status page shows your own requests only."


def snippet(base_url: str, traffic: bool = True) -> str:
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

Status page (live: pools, replicas, classes, latency, the latest requests' stages, 15 minutes of history):
    {base_url[:-3]}/ui

{TRAFFIC_ON if traffic else TRAFFIC_OFF}

Every response carries x-m3gate-pool and x-m3gate-endpoint. Ctrl-C stops everything.
"""


async def _serve(server: uvicorn.Server, traffic: DemoTraffic | None) -> None:
    """Run the gateway; once it listens, the sample traffic too, stopped as soon as the gateway starts to shut down
    (so that no sample request holds the shutdown up)."""
    serving = asyncio.ensure_future(server.serve())
    sending: asyncio.Future[None] | None = None
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if traffic is not None and server.started:
            sending = asyncio.ensure_future(traffic.run())
        while not serving.done() and not server.should_exit:
            await asyncio.wait({serving}, timeout=0.2)
    finally:
        if sending is not None:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    await serving


def run_demo(port: int = 8080, traffic: bool = True) -> int:
    from pools.sim.launcher import start_sim

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _port_free(port):
        print(f"port {port} is taken; run `m3gate demo --port N`", file=sys.stderr)
        return 2
    sims = []
    sample: DemoTraffic | None = None
    # SIGTERM as Ctrl-C, from the start: a stop while the simulators start still stops the ones already running
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for pool in DEMO_POOLS:
            sims.append(start_sim(pool["max_model_len"], model=MODEL, extra_args=pool["sim_args"]))
        endpoints = {pool["name"]: [sim.url] for pool, sim in zip(DEMO_POOLS, sims, strict=True)}
        config = demo_config(endpoints, port)
        base_url = f"http://127.0.0.1:{port}/v1"
        for pool, sim in zip(DEMO_POOLS, sims, strict=True):
            print(f"  pool {pool['name']:<12} {pool['max_model_len']:>8} tokens  simulator pid {sim.pid} at {sim.url}")
        print(snippet(base_url, traffic), flush=True)
        server = uvicorn.Server(uvicorn.Config(build_app(config), host="127.0.0.1", port=port, loop="none",
                                               http="httptools", log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=5))
        sample = DemoTraffic(f"http://127.0.0.1:{port}", MODEL) if traffic else None
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve(server, sample))
    except KeyboardInterrupt:
        pass
    finally:
        for sim in sims:
            sim.stop()
        stopped = f"gateway, simulators and sample traffic: {sample.summary()}" if sample else "gateway and simulators"
        print(f"m3gate demo stopped ({stopped}).", flush=True)
    return 0
