"""The client matrix (docs/clients.md): the clients people put in front of an OpenAI-compatible server, run as users
run them against one gateway with two simulated replicas.

Each client lives in its own virtualenv under the cache folder with pinned versions (`make clients`,
scripts/install-clients.sh); its check script (tests/clients/*_check.py) runs there and prints what the client saw
as JSON, which the tests below assert on. The three scripts run at once, so the module takes a few seconds past the
gateway's start. A client that is not installed is skipped by hand and FAILS under `make test` (M3GATE_REQUIRE_TOOLS).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from pools.sim.launcher import running_sims
from tests.clients.venvs import HERE, client_python, pinned, require_client

pytestmark = pytest.mark.clients

MODEL = "MiniMaxAI/MiniMax-M3"
CLIENTS = {"openai-agents": "openai_agents_check.py", "langchain": "langchain_check.py",
           "litellm": "litellm_check.py"}
# --tool-call-probability 0: a tool is called only when tool_choice forces it, so an agent loop ends after the
# tool's result (a real model decides; the simulator's choice would be a coin toss per prompt).
SIM_ARGS = ["--instant", "--tool-call-probability", "0", "--mean-output-tokens", "40"]


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    with running_sims([{"max_model_len": 32768, "extra_args": SIM_ARGS}] * 2) as sims:
        gw = start_gateway({"model": MODEL, "server": {"health_interval_s": 0.5},
                            "pools": [{"name": "p", "max_model_len": 32768, "endpoints": [s.url for s in sims]}]})
        try:
            yield gw
        finally:
            gw.stop()


@pytest.fixture(scope="module")
def reports(gateway: GatewayProcess) -> dict[str, dict[str, Any] | str]:
    """Every installed client's check script, run at once: its JSON report, or why there is none."""
    running = {}
    for name, script in CLIENTS.items():
        python = client_python(name)
        if python.exists():
            running[name] = subprocess.Popen([str(python), str(HERE / script), "--base-url", gateway.base_url],
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)
    out: dict[str, dict[str, Any] | str] = {}
    for name, proc in running.items():
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        try:
            out[name] = json.loads(stdout)
        except json.JSONDecodeError:
            out[name] = f"exit {proc.returncode}: {stderr[-3000:]}"
    return out


def report(reports: dict[str, dict[str, Any] | str], name: str) -> dict[str, Any]:
    """The scenarios of a client's report; skipped (by hand) or failed (under `make test`) where it isn't installed."""
    if name not in reports:
        require_client(name)
    got = reports[name]
    assert isinstance(got, dict), f"{name} check script failed: {got}"
    versions = {k: v for k, v in got["versions"].items() if k in pinned(name)}
    assert versions == pinned(name), f"{name} venv does not hold the pinned versions (make clients)"
    failed = {k: v["error"] + "\n" + v["traceback"] for k, v in got["scenarios"].items() if "error" in v}
    assert not failed, f"{name}: " + "\n".join(f"{k}: {v}" for k, v in failed.items())
    return got["scenarios"]


def test_openai_agents_tool_loop(reports: dict[str, Any]) -> None:
    """The agent calls the forced tool with the model's arguments, gets its result, then answers in words; with
    thinking on the SDK turns vLLM's `reasoning` into reasoning items, streamed as reasoning deltas."""
    scenarios = report(reports, "openai-agents")
    for name, seen in scenarios.items():
        think = name.endswith("thinking")
        assert seen["model_requests"] == 2, (name, seen)
        assert seen["calls"] == seen["tool_arguments"] and len(seen["calls"]) == 1, (name, seen)
        city = seen["calls"][0]["city"]
        assert isinstance(city, str) and seen["tool_outputs"] == [f"Sunny in {city}, 21 C."], (name, seen)
        assert [i for i in seen["items"] if i != "reasoning_item"] == [
            "tool_call_item", "tool_call_output_item", "message_output_item"], (name, seen)
        assert isinstance(seen["final_output"], str) and seen["final_output"].strip(), (name, seen)
        assert (seen["reasoning_items"] > 0) == think, (name, seen)
        if name.startswith("stream"):
            assert seen["text_deltas"] > 1 and (seen["reasoning_deltas"] > 0) == think, (name, seen)


def test_langchain_chat_openai(reports: dict[str, Any]) -> None:
    """Invoke and stream answer in words; a forced `bind_tools` call carries valid arguments and the tool's result
    sent back gets an answer; structured output parses into the pydantic model both ways."""
    seen = report(reports, "langchain")
    invoke, stream, tools = seen["invoke"], seen["stream"], seen["bind_tools"]
    assert invoke["content"].strip() and invoke["finish_reason"] == "stop", invoke
    # ChatOpenAI drops vLLM's `reasoning` field; the reasoning tokens still show in the usage.
    assert invoke["usage"]["output_token_details"]["reasoning"] > 0, invoke
    assert stream["chunks"] > 5 and stream["content"].strip() and stream["usage"]["output_tokens"] > 0, stream
    assert [c["name"] for c in tools["tool_calls"]] == ["get_weather"], tools
    assert isinstance(tools["tool_calls"][0]["args"]["city"], str), tools
    assert tools["tool_results"] == [f"Sunny in {tools['tool_calls'][0]['args']['city']}, 21 C."], tools
    assert tools["final_content"].strip() and tools["final_tool_calls"] == 0, tools
    for method in ("function_calling", "json_schema"):
        out = seen[f"structured_{method}"]
        assert out["type"] == "Person" and out["parsing_error"] is None, (method, out)
        assert 2 <= len(out["parsed"]["name"]) <= 20 and 0 <= out["parsed"]["age"] <= 120, (method, out)
        assert out["parsed"]["colour"] in ("red", "blue"), (method, out)
    assert seen["structured_function_calling"]["raw_tool_calls"] == 1
    assert json.loads(seen["structured_json_schema"]["raw_content"]) == seen["structured_json_schema"]["parsed"]


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
def test_litellm_providers(reports: dict[str, Any], provider: str) -> None:
    """Both providers answer plain and streamed, surface MiniMax-M3's reasoning as `reasoning_content` when thinking
    is on (none when off), and return the forced tool call with arguments that match its schema."""
    seen = report(reports, "litellm")
    plain, stream, tool = (seen[f"{provider}_{k}"] for k in ("plain", "stream", "tool_call"))
    assert plain["thinking"]["content"].strip() and plain["thinking"]["reasoning_content"].strip(), plain
    assert plain["no_thinking"]["content"].strip() and not plain["no_thinking"]["reasoning_content"], plain
    assert stream["chunks"] > 5 and stream["content"].strip() and stream["reasoning_content"].strip(), stream
    assert stream["finish_reason"] == "stop", stream
    assert [c["name"] for c in tool["tool_calls"]] == ["get_weather"], tool
    assert isinstance(tool["tool_calls"][0]["arguments"]["city"], str), tool

