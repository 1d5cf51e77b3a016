"""The load-test harness checked against what the simulated replicas themselves counted.

A tiny workload (chat classes with shared prefixes, thinking, tools, images; a few agent sessions) runs end to end
through a real gateway in front of two simulated replicas. The report's request, prompt-token and output-token
totals, its routing spread and its prefix-cache numbers must equal the replicas' own /sim/stats and /metrics; each
request's prompt tokens must equal what the oracle's tokenization predicts; and on a single replica with an
effectively infinite cache, the measured hit tokens must equal the oracle's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.launcher import GatewayProcess, start_gateway
from loadtests.lib.client import Target
from loadtests.lib.harness import execute
from loadtests.lib.oracle import oracle_hit_rates, prompt_token_count
from loadtests.lib.replicas import gateway_config
from loadtests.lib.workload import build_plan, load_workload
from pools.sim.launcher import SimProcess, running_sims

SIM_ARGS = ["--speed", "50", "--modalities", "text,image", "--tool-call-probability", "0"]

WORKLOAD: dict[str, Any] = {
    "name": "harness-selftest",
    "seed": 3,
    "duration_s": 8,
    "drain_s": 20,
    "arrival": {"process": "poisson", "rate": 25},
    "num_requests": 16,
    "classes": [
        {"name": "chat", "weight": 3, "prompt_tokens": [150, 700], "output_tokens": [4, 24],
         "shared_prefix": {"groups": 2, "tokens": 300}, "thinking_share": 0.5, "tools": {"count": 2},
         "slo": {"ttft_ms": 5000, "tpot_ms": 500}},
        {"name": "tool", "weight": 1, "prompt_tokens": 300, "output_tokens": 64, "tools": {"count": 3},
         "tool_call_share": 1.0},
        {"name": "vision", "weight": 1, "prompt_tokens": 200, "output_tokens": 8, "image_share": 1.0},
        {"name": "plain", "weight": 1, "api": "completions", "stream": False, "prompt_tokens": 100,
         "output_tokens": 5},
    ],
    "sessions": [
        {"name": "agent", "count": 3, "arrival": {"process": "constant", "rate": 4},
         "system_prompts": {"count": 1, "tokens": 400}, "tools": {"count": 2, "tokens_each": 60}, "turns": 3,
         "first_user_tokens": 100, "user_tokens": 40, "tool_result_share": 0.5, "tool_result_tokens": 150,
         "output_tokens": 12, "tool_call_output_tokens": 12, "think_time_s": 0.05, "tool_time_s": 0.05},
    ],
}


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    with running_sims([{"max_model_len": 8192, "extra_args": SIM_ARGS} for _ in range(2)]) as procs:
        yield procs


@pytest.fixture(scope="module")
def gateway(sims: list[SimProcess]) -> Iterator[GatewayProcess]:
    gw = start_gateway(gateway_config([s.url for s in sims], policy="round_robin", max_model_len=8192,
                                      modalities=("text", "image")))
    try:
        yield gw
    finally:
        gw.stop()


def test_report_matches_what_the_replicas_counted(sims: list[SimProcess], gateway: GatewayProcess,
                                                  tmp_path: Path) -> None:
    for s in sims:
        s.reset()
    plan = build_plan(WORKLOAD)
    report, run = execute(plan, Target(gateway=gateway.url), replicas=[s.url for s in sims], out_dir=tmp_path,
                          quiet=True, progress=False)
    stats = {s.url: s.stats() for s in sims}
    overall = report["overall"]

    # every planned request was sent and answered, and the replicas served exactly those
    assert report["sent"] == report["planned"] == len(plan.items)
    assert overall["failed"] == 0, overall["errors"]
    assert overall["completed"] == len(plan.items) == sum(st["completed"] for st in stats.values())
    generate = sum(st["requests"].get("/v1/chat/completions", 0) + st["requests"].get("/v1/completions", 0)
                   for st in stats.values())
    assert generate == len(plan.items)

    # token totals: the report's (from each response's usage) equal the replicas' engine counters
    assert overall["prompt_tokens"] == sum(st["tokens_in"] for st in stats.values())
    assert overall["output_tokens"] == sum(st["tokens_out"] for st in stats.values())

    # routing spread from x-m3gate-endpoint equals what each replica served
    per = report["routing"]["per_replica"]
    for url, st in stats.items():
        assert per[url]["requests"] == st["completed"]
        assert per[url]["prompt_tokens"] == st["tokens_in"]

    # prefix cache: the /metrics delta equals the replicas' own counters and the usage the client saw
    cache = report["prefix_cache"]
    assert cache["queries"] == sum(st["tokens_in"] for st in stats.values())
    assert cache["hits"] == sum(st["cached_tokens"] for st in stats.values())
    assert cache["hits"] == sum(r.cached_tokens or 0 for r in run.results)
    assert cache["hits"] > 0  # shared prefixes and growing sessions did hit

    # per request: prompt tokens as the oracle tokenizes them; output = max_tokens (ignore_eos) unless a tool call;
    # one ITL gap per output token after the role chunk for streamed chats without tool calls
    items = {i.index: i for i in plan.items}
    for r in run.results:
        item = items[r.index]
        assert r.prompt_tokens == prompt_token_count(item), (item.cls, r.index)
        assert r.ttft is not None and r.e2el is not None and 0 < r.ttft <= r.e2el
        if not item.tool_call:
            assert r.output_tokens == item.output_tokens
            if item.stream and item.api == "chat":
                assert len(r.itl) == r.output_tokens
    assert any(items[r.index].tool_call for r in run.results)

    # the per-class rows add up, goodput is counted against the SLOs, files are written
    assert sum(c["completed"] for c in report["classes"].values()) == overall["completed"]
    assert report["classes"]["chat"]["goodput"]["good"] <= report["classes"]["chat"]["completed"]
    assert {"report.json", "report.md", "results.jsonl", "trace.jsonl", "latency_cdf.png", "ttft_over_time.png",
            "replica_load.png"} <= {p.name for p in tmp_path.iterdir()}
    assert json.loads((tmp_path / "report.json").read_text())["overall"]["completed"] == overall["completed"]
    assert "| **overall** |" in (tmp_path / "report.md").read_text()

    # the written trace replays with the same requests, lengths and arrival order
    replay = build_plan({"trace": {"path": str(tmp_path / "trace.jsonl")}, "seed": 1})
    assert len(replay.items) == len(plan.items)
    recorded = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [i.output_tokens for i in replay.items] == [rec["output_length"] for rec in recorded]
    first = min(rec["timestamp"] for rec in recorded)
    assert all(abs(i.at - (rec["timestamp"] - first) / 1000) < 1e-6 for i, rec in zip(replay.items, recorded))
    assert [i.prompt_tokens_est for i in replay.items] == [rec["input_length"] for rec in recorded]


def test_hit_rate_on_one_replica_equals_the_oracle(sims: list[SimProcess], tmp_path: Path) -> None:
    """One replica with a cache far larger than the workload is the global oracle: hits must match exactly."""
    sim = sims[0]
    sim.reset()
    spec = {**WORKLOAD, "classes": [], "num_requests": None}
    spec["sessions"] = [{**WORKLOAD["sessions"][0], "count": 4, "turns": 4}]
    plan = build_plan({k: v for k, v in spec.items() if v is not None and k != "classes"})
    report, run = execute(plan, Target(replicas=[sim.url]), replicas=[sim.url], out_dir=None, quiet=True,
                          progress=False)
    assert report["overall"]["failed"] == 0
    oracle = oracle_hit_rates(plan, sent=[r.index for r in run.results])
    cache = report["prefix_cache"]
    assert cache["queries"] == oracle["prompt_tokens"]
    assert cache["hits"] / cache["queries"] == pytest.approx(oracle["global"], abs=1e-9)
    assert oracle["session"] <= oracle["global"]


def test_shipped_workloads_build() -> None:
    for name in ("smoke", "mixed", "agent", "bursty", "ramp", "stages", "sglang_gsp", "prefix_repetition",
                 "multi_round_qa", "inference_perf_shared_prefix", "llmd_shared_prefix", "replay_mooncake_sample",
                 "replay_simple_sample"):
        plan = load_workload(name)
        assert plan.items, name
    gsp = load_workload("sglang_gsp")
    assert len(gsp.items) == 64 * 16
    assert len({i.prefix_group for i in gsp.items}) == 64


async def test_client_timing_follows_vllm_bench_definitions() -> None:
    """TTFT / ITL / E2EL / TPOT from a server whose event times are known (vllm-contract.md §9)."""
    import asyncio

    from aiohttp import web

    from loadtests.lib.client import run_plan
    from loadtests.lib.client import tpot_of

    def chunk(text: str) -> bytes:
        return b'data: {"choices":[{"index":0,"delta":{"content":"' + text.encode() + b'"}}]}\n\n'

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.2)
        await resp.write(b": a comment line is skipped\n\n" + chunk("a")[:20])  # an event split across writes
        await asyncio.sleep(0.01)
        await resp.write(chunk("a")[20:])
        for text in ("b", "c", "d"):
            await asyncio.sleep(0.1)
            await resp.write(chunk(text))
        await resp.write(b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":4,'
                         b'"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        plan = build_plan({"num_requests": 1, "classes": [{"name": "c", "prompt_tokens": 8, "output_tokens": 4}]})
        run = await run_plan(plan, Target(replicas=[f"http://127.0.0.1:{port}"]), progress=False, drain_s=10)
    finally:
        await runner.cleanup()
    (r,) = run.results
    assert r.error is None and r.output_tokens == 4 and r.prompt_tokens == 7
    assert r.ttft == pytest.approx(0.21, abs=0.08)
    assert len(r.itl) == 3 and all(x == pytest.approx(0.1, abs=0.06) for x in r.itl)
    assert r.e2el == pytest.approx(0.51, abs=0.12)
    assert tpot_of(r) == pytest.approx((r.e2el - r.ttft) / 3)
