"""The spawn/wait/stop helper behind the local vLLM launcher and the prefill/decode pair, run against a stand-in
`vllm.entrypoints.openai.api_server` (a tiny HTTP server answering /health), so it needs no vLLM: servers start
together on the ports picked for them, a server that dies while starting stops the others and reports its log, and
stopping kills the whole process group."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from pools.vllm_local.processes import PendingServer, VllmStartError, start_together, stop_all

STAND_IN = """
import argparse, http.server, sys
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--fail", action="store_true")
args, _ = parser.parse_known_args()
if args.fail:
    print("stand-in: refusing to start", flush=True)
    sys.exit(3)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", args.port), Health).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PYTHONPATH folder whose `vllm.entrypoints.openai.api_server` is the stand-in; logs under tmp_path."""
    module = tmp_path / "lib" / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True)
    for folder in (module.parent.parent, module.parent, module):
        (folder / "__init__.py").write_text("")
    (module / "api_server.py").write_text(STAND_IN)
    monkeypatch.setenv("M3GATE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "lib"


def pending(lib: Path, *, fail: bool = False) -> PendingServer:
    def command(ports: Mapping[str, int]) -> tuple[tuple[str, ...], dict[str, str]]:
        args = ("--port", str(ports["port"]), "--side", str(ports["side"]), *(("--fail",) if fail else ()))
        return args, {**os.environ, "PYTHONPATH": str(lib)}

    return PendingServer(Path(sys.executable), 2048, lib, command, ("side",))


def test_servers_start_together_on_their_own_ports_and_stop_as_a_group(stand_in: Path) -> None:
    servers = start_together([pending(stand_in), pending(stand_in)], timeout=30)
    try:
        assert len({s.port for s in servers}) == 2
        for server in servers:
            assert set(server.ports) == {"port", "side"} and server.ports["port"] == server.port
            assert server.args[:2] == ("--port", str(server.port))
            assert httpx.get(server.url + "/health").status_code == 200
            assert server.alive() and server.start_seconds > 0
    finally:
        stop_all(servers, timeout=5)
    assert not any(s.alive() for s in servers)


def test_a_server_that_dies_while_starting_stops_the_others(stand_in: Path) -> None:
    healthy, failing = pending(stand_in), pending(stand_in, fail=True)
    began = time.monotonic()
    with pytest.raises(VllmStartError, match=r"exited with rc=3 while starting(.|\n)*stand-in: refusing to start"):
        start_together([healthy, failing], timeout=30)
    assert time.monotonic() - began < 20
    assert healthy.proc is not None and healthy.proc.poll() is not None  # stopped, not left running
