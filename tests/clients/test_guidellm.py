"""vLLM's GuideLLM through the gateway (docs/clients.md): a short run on each request format it sends to an
OpenAI-compatible server (chat completions, completions, the Responses API), streamed, against one gateway in front
of two simulated replicas.

GuideLLM runs as users run it, its `guidellm run` CLI from its own venv (`make clients`), with a scenario file and
the tiny model's tokenizer from local disk (it counts the synthetic prompts' tokens; nothing is downloaded). The three
runs go at once, each bounded by a request count. Its own JSON report must count 0 errors and every request complete
with the output length asked for, and the gateway's counters must show each request answered.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import running_sims
from pools.vllm_local.tiny_model import ensure_tiny_tokenizer
from tests.clients.venvs import finish, gateway_requests, installed_versions, pinned, read_report, require_client

pytestmark = pytest.mark.clients

MODEL = "MiniMaxAI/MiniMax-M3"
# GuideLLM's request format → the gateway's `api` label
FORMATS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses"}
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 12, 64, 16


@pytest.fixture(scope="module")
def venv() -> Path:
    """guidellm's venv, looked up before any replica starts (missing: skipped by hand, failed under `make test`)."""
    return require_client("guidellm")


@pytest.fixture(scope="module")
def tokenizer() -> Path:
    return ensure_tiny_tokenizer()


@pytest.fixture(scope="module")
def gateway(tokenizer: Path) -> Iterator[GatewayProcess]:
    # The replicas count tokens with the tokenizer GuideLLM uses, so its prompt lengths are theirs.
    args = ["--instant", "--tokenizer", str(tokenizer)]
    with running_sims([{"max_model_len": 32768, "extra_args": args}] * 2) as sims:
        gw = start_gateway({"model": MODEL, "server": {"health_interval_s": 0.5},
                            "pools": [{"name": "p", "max_model_len": 32768, "endpoints": [s.url for s in sims]}]})
        try:
            yield gw
        finally:
            gw.stop()


def scenario(gw: GatewayProcess, request_format: str, tokenizer: Path, report: Path) -> dict[str, Any]:
    """A GuideLLM scenario file: REQUESTS synthetic prompts over 4 streams, stopped by count (or 60 s)."""
    return {"spec": {
        "backend": {"kind": "openai_http", "target": gw.url, "model": MODEL, "request_format": request_format,
                    "timeout": 30},
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "profile": {"kind": "concurrent", "streams": 4},
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}],
        "constraints": [{"kind": "max_requests", "count": REQUESTS}, {"kind": "max_duration", "seconds": 60}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}


@pytest.fixture(scope="module")
def runs(venv: Path, gateway: GatewayProcess, tokenizer: Path,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each format's report (or why there is none), and the requests the gateway answered during the runs."""
    tmp = tmp_path_factory.mktemp("guidellm")
    # One worker process per run (its default is up to 10, each importing torch); HF_HUB_OFFLINE: local files only.
    env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf")}
    before = gateway_requests(gateway.url)
    running = {}
    for fmt, api in FORMATS.items():
        (tmp / f"{api}.json").write_text(json.dumps(scenario(gateway, fmt, tokenizer, tmp / f"{api}-report.json")))
        running[api] = subprocess.Popen(
            [str(venv / "bin" / "guidellm"), "run", "-c", str(tmp / f"{api}.json"), "--disable-console"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp)
    out: dict[str, Any] = {api: read_report(tmp / f"{api}-report.json", proc, finish(proc))
                           for api, proc in running.items()}
    after = gateway_requests(gateway.url)
    out["served"] = {api: after.get(api, 0.0) - before.get(api, 0.0) for api in FORMATS.values()}
    return out


def test_guidellm_venv_holds_the_pins(venv: Path) -> None:
    assert installed_versions("guidellm") == pinned("guidellm"), "the guidellm venv is stale (make clients)"


@pytest.mark.parametrize("api", FORMATS.values())
def test_guidellm_run_has_no_errors(runs: dict[str, Any], api: str) -> None:
    """Every request succeeded in GuideLLM's own count, each streamed the output length it asked for, the prompt
    lengths are the replicas' own counts, and each request went through the gateway."""
    report = runs[api]
    assert isinstance(report, dict), f"guidellm on {api} wrote no report: {report}"
    [benchmark] = report["benchmarks"]
    metrics = benchmark["metrics"]
    assert metrics["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    output = metrics["output_token_count"]["successful"]
    assert output["count"] == REQUESTS and output["min"] == output["max"] == OUTPUT_TOKENS, output
    # A chat template wraps the prompt (more tokens); a plain completion is exactly the synthetic prompt.
    prompt = metrics["prompt_token_count"]["successful"]
    assert prompt["min"] >= PROMPT_TOKENS and (api != "completions" or prompt["max"] == PROMPT_TOKENS), prompt
    assert metrics["time_to_first_token_ms"]["successful"]["count"] == REQUESTS
    assert runs["served"][api] == REQUESTS, runs["served"]
