"""The Kubernetes inference-perf tool through the gateway (docs/clients.md): its `shared_prefix` workload, once with
the default routing (prefix affinity) and once with round robin, each against a gateway in front of three fresh
simulated replicas.

inference-perf runs as users run it, its CLI from its own venv (`make clients`) with a config file and the tiny
model's tokenizer from local disk (it builds the prompts from token ids; nothing is downloaded). Its report must
count 0 failures, the gateway must have answered every request, and the share of prompt tokens the replicas served
from their prefix cache (their `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`) must be higher with prefix
affinity than with round robin: that share is what the tool's workload measures. The two runs go at once.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.launcher import start_gateway
from loadtests.lib.replicas import scrape_counters
from pools.sim.launcher import running_sims
from pools.vllm_local.tiny_model import ensure_tiny_tokenizer
from tests.clients.venvs import finish, gateway_requests, installed_versions, pinned, read_report, require_client

pytestmark = pytest.mark.clients

MODEL = "MiniMaxAI/MiniMax-M3"
ROUTINGS = {"prefix_affinity": {}, "round_robin": {"routing": {"policy": "round_robin"}}}
# 4 system prompts of 4 KV blocks (the replicas' blocks are 128 tokens), 6 questions each, in a seeded shuffle.
SHARED_PREFIX = {"num_groups": 4, "num_prompts_per_group": 6, "system_prompt_len": 512, "question_len": 32,
                 "output_len": 16, "seed": 7}
REQUESTS = SHARED_PREFIX["num_groups"] * SHARED_PREFIX["num_prompts_per_group"]


@pytest.fixture(scope="module")
def venv() -> Path:
    """inference-perf's venv, looked up before any replica starts (missing: skipped by hand, FAILED by `make test`)."""
    return require_client("inference-perf")


@pytest.fixture(scope="module")
def tokenizer() -> Path:
    return ensure_tiny_tokenizer()


@pytest.fixture(scope="module")
def gateways(tokenizer: Path) -> Iterator[dict[str, tuple[str, list[str]]]]:
    """Per routing: the gateway's URL and its three replicas' URLs (replicas that count with the tool's tokenizer)."""
    sim = {"max_model_len": 32768, "extra_args": ["--instant", "--tokenizer", str(tokenizer)]}
    with ExitStack() as stack:
        out = {}
        for name, routing in ROUTINGS.items():
            sims = stack.enter_context(running_sims([sim] * 3))
            gw = start_gateway({"model": MODEL, "server": {"health_interval_s": 0.5}, **routing,
                                "pools": [{"name": "p", "max_model_len": 32768, "endpoints": [s.url for s in sims]}]})
            stack.callback(gw.stop)
            out[name] = (gw.url, [s.url for s in sims])
        yield out


def config(gateway_url: str, tokenizer: Path, reports: Path) -> dict[str, Any]:
    """An inference-perf config: the shared-prefix prompts on streamed completions, 2 at a time, one worker."""
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "shared_prefix", "shared_prefix": SHARED_PREFIX},
        "load": {"type": "concurrent", "num_workers": 1,
                 "stages": [{"num_requests": REQUESTS, "concurrency_level": 2}]},
        "server": {"type": "vllm", "model_name": MODEL, "base_url": gateway_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "storage": {"local_storage": {"path": str(reports)}},
    }


@pytest.fixture(scope="module")
def runs(venv: Path, gateways: dict[str, tuple[str, list[str]]], tokenizer: Path,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per routing: the tool's summary report (or why there is none), the gateway's answered completions and the
    replicas' prefix-cache counters over the run."""
    tmp = tmp_path_factory.mktemp("inference-perf")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "hf")}
    running = {}
    for name, (url, _) in gateways.items():
        (tmp / f"{name}.yaml").write_text(json.dumps(config(url, tokenizer, tmp / name)))  # JSON is YAML
        running[name] = subprocess.Popen([str(venv / "bin" / "inference-perf"), "--config_file", f"{name}.yaml"],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                         cwd=tmp)
    out: dict[str, dict[str, Any]] = {}
    for name, proc in running.items():
        log = finish(proc)
        url, replicas = gateways[name]
        counters = [scrape_counters(r) for r in replicas]
        out[name] = {
            "summary": read_report(tmp / name / "summary_lifecycle_metrics.json", proc, log),
            "served": gateway_requests(url).get("completions", 0.0),
            "hits": sum(c["hits"] for c in counters), "queries": sum(c["queries"] for c in counters)}
    return out


def test_inference_perf_venv_holds_the_pins(venv: Path) -> None:
    assert installed_versions("inference-perf") == pinned("inference-perf"), "stale venv (make clients)"


@pytest.mark.parametrize("routing", ROUTINGS)
def test_shared_prefix_run_has_no_failures(runs: dict[str, dict[str, Any]], routing: str) -> None:
    run = runs[routing]
    summary = run["summary"]
    assert isinstance(summary, dict), f"inference-perf ({routing}) wrote no report: {summary}"
    assert summary["failures"]["count"] == 0, summary["failures"]
    assert summary["successes"]["count"] == REQUESTS == summary["load_summary"]["count"]
    assert run["served"] == REQUESTS, run
    # Every prompt token reached a replica: each prompt is 544 tokens (512 shared + 32 of its own).
    prompt_len = SHARED_PREFIX["system_prompt_len"] + SHARED_PREFIX["question_len"]
    assert run["queries"] == REQUESTS * prompt_len, run


def test_prefix_affinity_serves_more_prompt_tokens_from_cache(runs: dict[str, dict[str, Any]]) -> None:
    """Prefix affinity keeps each system prompt on one replica, so only a group's first request misses; round robin
    spreads each group over the three replicas, and each replica's first request of a group misses."""
    share = {name: run["hits"] / run["queries"] for name, run in runs.items() if run["queries"]}
    print(f"prompt tokens served from prefix cache: {share}")
    assert share.keys() == ROUTINGS.keys(), runs
    assert share["prefix_affinity"] > share["round_robin"], share
