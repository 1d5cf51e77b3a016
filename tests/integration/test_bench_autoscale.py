"""bench_autoscale's machinery, briefly (not the benchmark): the actuator adds a simulated replica when asked (a spare
process, restocked behind it), the gateway sends it traffic only once the start-up delay has passed and it is in the
hot-reloaded pool file, and stops once it is removed; a tiny day through all four policies gives the table with its columns and verdicts."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest

from loadtests.bench import autoscale as bench_autoscale
from loadtests.lib.autoscale import CLASS_HEADER, MODEL, Actuator, Timescale, gateway_config
from loadtests.lib.replicas import GatewayProc, wait_gateway_sees
from loadtests.lib.results import read

FAST_SIM = ("--prefill-us-per-token", "20", "--decode-ms-per-step", "2", "--mean-output-tokens", "4")
STARTUP_S = 3.0


async def _served_by(http: aiohttp.ClientSession, url: str) -> str | None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there " * 20}], "max_tokens": 4,
            "stream": True}
    async with http.post(url + "/v1/chat/completions", json=body, headers={CLASS_HEADER: "interactive"}) as resp:
        await resp.read()
        assert resp.status == 200, resp.status
        return resp.headers.get("x-m3gate-endpoint")


async def _scenario(actuator: Actuator, gateway_url: str) -> dict[str, object]:
    seen: list[tuple[float, str | None]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        asked = actuator.clock()
        await actuator.scale_to(2, "test")
        assert actuator.target == 2 and len(actuator.ready) == 1
        while actuator.clock() - asked < STARTUP_S + 6.0:
            actuator.tick()
            seen.append((actuator.clock() - asked, await _served_by(http, gateway_url)))
            await asyncio.sleep(0.05)
        new = actuator.replicas[-1]
        assert new.joined_at is not None
        removed_at = actuator.clock()
        await actuator.scale_to(1, "test")
        await asyncio.sleep(1.5)  # the reload
        after = [await _served_by(http, gateway_url) for _ in range(20)]
    return {"seen": seen, "new": new.sim.url, "spares": [sim.url for sim in actuator.spares], "joined_s": new.joined_at - asked, "after": after,
            "billed": actuator.replica_seconds(asked, removed_at), "span": removed_at - asked}


async def _run_with_gateway() -> tuple[dict[str, object], str, str]:
    """One event loop for the actuator's whole life (its restocking tasks belong to it)."""
    actuator = Actuator("t", {}, None, STARTUP_S, time.monotonic, sim_args=FAST_SIM)
    gw = None
    try:
        await actuator.start_now(1, spares=1)
        first, spare = actuator.urls()[0], actuator.spares[0].url
        config = gateway_config([first], Timescale(), max_replicas=4)
        gw = await asyncio.to_thread(GatewayProc, config)
        actuator.config, actuator.pool_file = config, gw.config_path
        await asyncio.to_thread(wait_gateway_sees, gw.url, 1, 30.0)
        return await _scenario(actuator, gw.url), first, spare
    finally:
        if gw is not None:
            await asyncio.to_thread(gw.stop)
        await actuator.close()


def test_a_new_replica_gets_traffic_only_after_the_start_up_delay_and_none_once_removed() -> None:
    out, first, spare = asyncio.run(_run_with_gateway())
    joined = float(out["joined_s"])  # type: ignore[arg-type]
    assert STARTUP_S <= joined < STARTUP_S + 2.0
    early = [who for t, who in out["seen"] if t < STARTUP_S]  # type: ignore[union-attr]
    late = [who for t, who in out["seen"] if t > joined + 1.5]  # type: ignore[union-attr]
    assert early and all(who == first for who in early)  # started, but not in the pool file yet
    assert out["new"] in late  # in the file: the gateway reloaded it and routes to it
    assert out["new"] not in out["after"] and set(out["after"]) == {first}  # removed: no new traffic
    assert out["new"] == spare and len(out["spares"]) == 1 and spare not in out["spares"]  # a spare, restocked
    # billed from the ask, start-up included: the first replica the whole span, the new one until its removal
    assert float(out["billed"]) == pytest.approx(2 * float(out["span"]), rel=0.05)  # type: ignore[arg-type]


def test_a_tiny_day_through_the_four_policies_gives_the_table(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_autoscale.main(["--quick", "--hour-s", "0.4", "--control", "0.02", "--initial", "1", "--fixed", "1",
                               "--drain-s", "10", "--out", str(tmp_path)])
    assert rc == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("| policy |"))
    for column in ("interactive met", "repository met", "all met", "replica-seconds", "scale events",
                   "constant-load changes / 10 min"):
        assert column in header
    data = json.loads((tmp_path / "bench_autoscale.json").read_text())
    assert set(data["policies"]) == {"m3gate", "keda", "llm-d", "fixed"}
    day = data["day_s"]
    for name, p in data["policies"].items():
        assert p["classes"]["interactive"]["requests"] > 0, name
        assert 0.0 <= p["classes"]["interactive"]["attainment_pct"] <= 100.0
        assert p["replica_seconds"] >= day * 0.9  # never fewer than one replica
    fixed = data["policies"]["fixed"]
    assert fixed["scale_events"] == 0 and fixed["replica_seconds"] == pytest.approx(day, rel=0.05)
    assert set(data["verdicts"]) == {"vs fixed", "vs keda", "vs llm-d", "constant load"}
    assert all(isinstance(v["pass"], bool) for v in data["verdicts"].values())
    assert [row["phase"] for row in data["model_check"]][0] == "night"
    assert (tmp_path / "bench_autoscale.md").read_text().startswith("### Autoscaling on a compressed day")
    results = read(tmp_path / "results.json")  # the one results format: the verdicts, each with its pass/fail
    verdicts = {f["name"]: f["passed"] for f in results["figures"] if f["goal"]}
    assert len(verdicts) == 4 and all(isinstance(v, bool) for v in verdicts.values())
    assert results["passed"] == all(v["pass"] for v in data["verdicts"].values())
