"""Prefill/decode disaggregation against aggregated serving, at equal replica count, on simulated replicas.

`python -m loadtests.bench.pd [--quick] [--rounds N] [--out DIR]` starts four simulated MiniMax-M3 replicas (vLLM-like timing:
a step costs 12 ms + 60 µs per prefilled token, divided by `--speed`) and, for each configuration, a gateway:

- **aggregated**: one pool of the 4 replicas (each prefills and decodes);
- **disaggregated**: 2 prefill + 2 decode replicas, `min_uncached_tokens` = 4096 (the default);
- **sweep**: the disaggregated pool at other thresholds (`--sweep`).

The same seeded trace runs against each (configurations interleaved round by round, replicas' caches reset in
between; medians over rounds): a long-prompt trace (prompts of 64K–512K tokens scaled by `--scale`, unique, with
moderate streamed outputs, arriving at random) mixed with interactive decode-heavy sessions (closed loop; a shared
system prompt, a growing history, short new turns, long streamed answers). Per configuration it reports the
interactive inter-token latency (ITL, gaps between streamed chunks) p99, time per output token (TPOT) p95 and time
to first token (TTFT) p95, the long requests' TTFT p95, and goodput: requests per second meeting their class's SLO
(interactive: TTFT ≤ 1 s and TPOT ≤ 50 ms; long: TTFT ≤ 30 s and TPOT ≤ 100 ms, in the simulator's time). Targets:
interactive ITL p99 and TPOT p95 ≤ 0.5× aggregated, TTFT p95 ≤ 1.2× aggregated.

The replicas keep their roles in both configurations: as NIXL's, a role is a label, and a replica sent no
kv_transfer_params prefills and decodes like any other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gateway.cli.launcher import GatewayProcess, start_gateway
from loadtests.lib.harness import run_dir
from loadtests.lib.results import Results
from pools.sim.launcher import SimProcess, start_sim

MODEL = "MiniMaxAI/MiniMax-M3"
MAX_MODEL_LEN = 131072
SLO = {"interactive": (1.0, 0.050), "long": (30.0, 0.100)}  # (TTFT s, TPOT s)
TARGETS = {"itl_p99": 0.5, "tpot_p95": 0.5, "ttft_p95": 1.2}
VOCAB = [w for w in ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega", "vector", "matrix", "tensor", "kernel", "buffer", "socket", "thread", "module", "render", "parse", "yield", "await", "signal", "commit", "branch", "merge", "rebase"]]


@dataclass
class Sample:
    kind: str
    ttft: float | None = None
    tpot: float | None = None
    gaps: list[float] = field(default_factory=list)
    ok: bool = False

    def meets_slo(self) -> bool:
        ttft, tpot = SLO[self.kind]
        return self.ok and self.ttft is not None and self.ttft <= ttft and (self.tpot is None or self.tpot <= tpot)


def text(rng: random.Random, tokens: int, tag: str) -> str:
    """About `tokens` simulated tokens (4 bytes each), unique to `tag`."""
    words, size = [tag], len(tag)
    while size < tokens * 4:
        word = rng.choice(VOCAB) + str(rng.randrange(1000))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


@dataclass
class Trace:
    long: list[tuple[float, str, int]]  # (send at, prompt, max_tokens)
    sessions: list[list[tuple[str, int]]]  # per session: (new user turn, max_tokens) per turn
    system: str


def make_trace(seed: int, duration: float, scale: float, long_every_s: float, sessions: int) -> Trace:
    rng = random.Random(seed)
    long, t = [], 0.5
    while t < duration - 2:
        tokens = int(rng.uniform(65536, 524288) * scale)
        long.append((t, text(rng, tokens, f"L{seed}-{len(long)}"), rng.randint(96, 192)))
        t += rng.expovariate(1 / long_every_s)
    per_session = [[(text(rng, rng.randint(150, 600), f"S{seed}-{s}-{i}"), rng.randint(160, 256))
                    for i in range(40)] for s in range(sessions)]
    return Trace(long, per_session, text(rng, 1500, f"SYS{seed}"))


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any], kind: str) -> Sample:
    sample = Sample(kind)
    t0 = time.monotonic()
    chunks: list[float] = []
    try:
        async with http.post(url, json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return sample
            async for line in resp.content:
                if line.startswith(b"data: {") and (b'"content"' in line or b'"reasoning' in line):
                    if b'"content":""' in line and b'"role"' in line:
                        continue  # the role chunk carries no token
                    chunks.append(time.monotonic())
                elif line.startswith(b"data: [DONE]"):
                    sample.ok = True
    except (TimeoutError, aiohttp.ClientError):
        return sample
    if chunks:
        sample.ttft = chunks[0] - t0
        sample.gaps = [b - a for a, b in zip(chunks, chunks[1:], strict=False)]
        if len(chunks) > 1:
            sample.tpot = (chunks[-1] - chunks[0]) / (len(chunks) - 1)
    return sample


async def run_trace(gateway: str, trace: Trace, duration: float) -> list[Sample]:
    url = gateway + "/v1/chat/completions"
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        start = time.monotonic()

        async def one_long(at: float, prompt: str, max_tokens: int) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "disabled"}}
            samples.append(await stream(http, url, body, "long"))

        async def session(turns: list[tuple[str, int]], offset: float) -> None:
            await asyncio.sleep(offset)
            history: list[dict[str, str]] = [{"role": "system", "content": trace.system}]
            for user, max_tokens in turns:
                if time.monotonic() - start > duration:
                    return
                history.append({"role": "user", "content": user})
                body = {"model": MODEL, "messages": history, "max_tokens": max_tokens, "stream": True,
                        "ignore_eos": True, "chat_template_kwargs": {"thinking_mode": "disabled"}}
                sample = await stream(http, url, body, "interactive")
                samples.append(sample)
                history.append({"role": "assistant", "content": "ok " * 40})
                await asyncio.sleep(0.2)

        tasks = [one_long(*item) for item in trace.long]
        tasks += [session(turns, i * 0.1) for i, turns in enumerate(trace.sessions)]
        await asyncio.gather(*tasks)
    return samples


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


def summarise(samples: list[Sample], duration: float) -> dict[str, float]:
    inter = [s for s in samples if s.kind == "interactive"]
    long = [s for s in samples if s.kind == "long"]
    gaps = [g for s in inter for g in s.gaps]
    return {
        "itl_p99": pct(gaps, 0.99),
        "itl_p999": pct(gaps, 0.999),
        "tpot_p95": pct([s.tpot for s in inter if s.tpot is not None], 0.95),
        "ttft_p95": pct([s.ttft for s in inter if s.ttft is not None], 0.95),
        "long_ttft_p95": pct([s.ttft for s in long if s.ttft is not None], 0.95),
        "long_tpot_p95": pct([s.tpot for s in long if s.tpot is not None], 0.95),
        "goodput": sum(s.meets_slo() for s in samples) / duration,
        "goodput_interactive": sum(s.meets_slo() for s in inter) / duration,
        "goodput_long": sum(s.meets_slo() for s in long) / duration,
        "requests": float(len(samples)),
        "failed": float(sum(not s.ok for s in samples)),
    }


def gateway_config(sims: dict[str, list[SimProcess]], threshold: int | None) -> dict[str, Any]:
    pool: dict[str, Any] = {"name": "extended", "max_model_len": MAX_MODEL_LEN}
    if threshold is None:
        pool["endpoints"] = [s.url for s in (*sims["prefill"], *sims["decode"])]
    else:
        pool["disaggregation"] = {"prefill": {"endpoints": [s.url for s in sims["prefill"]]},
                                  "decode": {"endpoints": [s.url for s in sims["decode"]]},
                                  "min_uncached_tokens": threshold}
    return {
        "model": MODEL, "pools": [pool],
        "server": {"health_interval_s": 0.5},
        "traffic": {"classes": {"extended": {"max_concurrency": 256, "queue_length": 1024, "max_queue_wait_s": 300,
                                             "ttft_target_s": SLO["long"][0]}},
                    "saturation": {"max_waiting": None, "max_kv_usage": None}},
    }


def run_config(sims: dict[str, list[SimProcess]], threshold: int | None, trace: Trace, duration: float
               ) -> tuple[dict[str, float], dict[str, float]]:
    for s in (*sims["prefill"], *sims["decode"]):
        s.reset()
    gw: GatewayProcess = start_gateway(gateway_config(sims, threshold))
    try:
        t0 = time.monotonic()
        samples = asyncio.run(run_trace(gw.url, trace, duration))
        elapsed = time.monotonic() - t0
        decisions = _decisions(gw.url)
    finally:
        gw.stop()
    return summarise(samples, elapsed), decisions


def _decisions(url: str) -> dict[str, float]:
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("m3gate_pd_decisions_total{"):
            path = line.split('path="')[1].split('"')[0]
            out[path] = float(line.rsplit(" ", 1)[1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one short round, two sweep points (under 2 minutes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of trace per run")
    parser.add_argument("--speed", type=float, default=2.0, help="simulator speed-up of every step")
    parser.add_argument("--scale", type=float, default=1 / 8, help="long prompts: 64K-512K tokens times this")
    parser.add_argument("--long-every", type=float, default=0.8, help="mean seconds between long requests")
    parser.add_argument("--sessions", type=int, default=8, help="interactive sessions (closed loop)")
    parser.add_argument("--sweep", type=int, nargs="*", default=[0, 1024, 16384, 32768])
    parser.add_argument("--out", type=Path, help="results folder: results.json, bench_pd.json (default "
                        "loadtests/results/<time>-pd)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # a killed bench still stops its replicas and gateway
    if args.quick:
        args.rounds, args.duration, args.sweep = 1, 18.0, [0]
    sim_args = ["--speed", str(args.speed)]
    sims: dict[str, list[SimProcess]] = {"prefill": [], "decode": []}
    configs: list[tuple[str, int | None]] = [("aggregated", None), ("disaggregated", 4096)]
    configs += [(f"disaggregated@{t}", t) for t in args.sweep if t != 4096]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in configs}
    decisions: dict[str, dict[str, float]] = {}
    try:
        for role in ("prefill", "prefill", "decode", "decode"):
            sims[role].append(start_sim(MAX_MODEL_LEN, extra_args=["--role", role, *sim_args]))
        for r in range(args.rounds):
            trace = make_trace(1000 + r, args.duration, args.scale, args.long_every, args.sessions)
            order = configs if r % 2 == 0 else list(reversed(configs))  # interleaved
            for name, threshold in order:
                summary, paths = run_config(sims, threshold, trace, args.duration)
                results[name].append(summary)
                decisions[name] = paths
                print(f"round {r + 1}/{args.rounds} {name}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in summary.items()), flush=True)
    finally:
        for s in (*sims["prefill"], *sims["decode"]):
            s.stop()
    medians = {name: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
               for name, runs in results.items() if runs}
    print(report(medians, decisions, args, results))
    folder = args.out or run_dir("pd")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench_pd.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                      "medians": medians, "runs": results, "decisions": decisions},
                                                     indent=2))
    results_of(medians, args).write(folder)
    print(f"results: {folder}")
    return 0


def results_of(medians: dict[str, dict[str, float]], args: argparse.Namespace) -> Results:
    """The targets (disaggregated's interactive ITL p99, TPOT p95 and TTFT p95 over aggregated's) and each
    configuration's goodput, in the one results format."""
    out = Results("pd", vars(args), reference="4 aggregated replicas on the same trace, interleaved rounds")
    base, pd = medians["aggregated"], medians["disaggregated"]
    for key, target in TARGETS.items():
        metric, quantile = key.split("_")
        out.add(f"interactive {metric.upper()} {quantile}, disaggregated / aggregated",
                pd[key] / base[key] if base[key] else None, "×", at_most=target)
    for name, m in medians.items():
        out.add(f"{name}: goodput", m["goodput"], "req/s")
    return out


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def report(medians: dict[str, dict[str, float]], decisions: dict[str, dict[str, float]], args: Any,
           runs: dict[str, list[dict[str, float]]]) -> str:
    base = medians["aggregated"]
    lines = [f"bench_pd: {args.rounds} round(s) x {args.duration:g} s, speed {args.speed:g}, long prompts "
             f"{int(65536 * args.scale)}-{int(524288 * args.scale)} tokens every ~{args.long_every:g} s, "
             f"{args.sessions} interactive sessions; medians of interleaved rounds", "",
             "| configuration | interactive ITL p99 (p99.9) ms | TPOT p95 ms | TTFT p95 ms | long TTFT p95 s | "
             "goodput req/s (interactive + long) | requests (failed) | decider paths (last round) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in medians.items():
        paths = ", ".join(f"{k} {int(v)}" for k, v in sorted(decisions.get(name, {}).items()) if v)
        lines.append(f"| {name} | {m['itl_p99'] * 1000:.0f} ({m['itl_p999'] * 1000:.0f}) | {m['tpot_p95'] * 1000:.1f} | {m['ttft_p95'] * 1000:.0f} | "
                     f"{m['long_ttft_p95']:.2f} | {m['goodput']:.2f} ({m['goodput_interactive']:.2f} + "
                     f"{m['goodput_long']:.2f}) | {int(m['requests'])} ({int(m['failed'])}) | {paths or '-'} |")
    pd = medians["disaggregated"]
    lines.append("(each column the median of its own per-round values)")
    lines.append("")
    for key, target in TARGETS.items():
        ratio = pd[key] / base[key] if base[key] else float("nan")
        rounds = ", ".join(f"{p[key] / a[key]:.2f}" for p, a in zip(runs["disaggregated"], runs["aggregated"],
                                                                     strict=False) if a[key])
        lines.append(f"disaggregated / aggregated {key}: {ratio:.2f} (per round: {rounds}; target <= {target}) "
                     f"{'OK' if ratio <= target else 'MISSED'}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
