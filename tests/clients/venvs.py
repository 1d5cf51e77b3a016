"""The client virtualenvs of the matrix (scripts/install-clients.sh): where each lives, what it pins, and what a
missing one means (skipped when run by hand, FAILED under `make test`, see tests/support/tools.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pools.vllm_local.paths import cache_dir
from tests.support.tools import REQUIRE_ENV, tools_required

HERE = Path(__file__).resolve().parent


def client_venv(name: str) -> Path:
    return cache_dir() / "clients" / name


def client_python(name: str) -> Path:
    return client_venv(name) / "bin" / "python"


def pinned(name: str) -> dict[str, str]:
    """The `pkg==version` pins of a client's requirements file (what the venv was built from)."""
    lines = (HERE / f"requirements-{name}.txt").read_text().splitlines()
    pins = [line.split("#")[0].strip() for line in lines]
    return dict(pin.split("==", 1) for pin in pins if pin)


def require_client(name: str) -> Path:
    """The client's venv; skipped (by hand) or failed (under `make test`) where it isn't installed."""
    if not client_python(name).exists():
        message = f"client {name} not installed in {client_venv(name)} (make clients)"
        if tools_required():
            pytest.fail(f"{message}; {REQUIRE_ENV}=1 or CI is set, so a missing client fails instead of skipping",
                        pytrace=False)
        pytest.skip(message)
    return client_venv(name)


def installed_versions(name: str) -> dict[str, str]:
    """The versions the venv holds of the packages its requirements file pins (a local tag such as torch's `+cpu`
    dropped), read by the venv's own python."""
    code = ("import importlib.metadata as md, json, sys; "
            "print(json.dumps({p: md.version(p).split('+')[0] for p in sys.argv[1:]}))")
    out = subprocess.run([str(client_python(name)), "-c", code, *pinned(name)], capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> str:
    """Wait for a client's process (killed past `timeout`); its output, for a failure's message."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0]


def read_report(path: Path, proc: subprocess.Popen[str], log: str) -> dict[str, Any] | str:
    """The JSON report a client wrote, or why there is none (its exit status and the tail of its output)."""
    return json.loads(path.read_text()) if path.exists() else f"exit {proc.returncode}: {log[-3000:]}"


def gateway_requests(url: str) -> dict[str, float]:
    """The gateway's answered requests with status 200, by `api` (m3gate_requests_total)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "m3gate_requests_total" and s.labels.get("status") == "200":
                out[s.labels["api"]] = out.get(s.labels["api"], 0.0) + s.value
    return out
