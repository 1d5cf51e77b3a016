"""The operating contract: what each traffic class is promised, written from the config and checked against
observations. Pure: no I/O (the CLI reads files and asks Prometheus; the load-test harness measures).

- `build_contract(config)`: per class, the pools that serve it (`policies.traffic.pool_class`), its context
  ceiling (largest `max_model_len`), warm capacity (replicas, KV blocks), precision and kernel path (the pools'
  `launch`: checkpoint variant, KV-cache dtype as the recipe resolves it, hardware, attention backend, EAGLE3
  speculative decoding) and the latency percentiles it must hold (`traffic.classes.*.targets`).
- `check(contract, observed)`: PASS / FAIL / NO DATA per class, metric and percentile; for each failure the stage
  (gateway queue, engine queue + prefill, decode) with the largest P95.
- `to_markdown` / `to_html`: the contract and, when checked, its verdicts, with inline SVG plots (no libraries).
- `slo_rules(config, bounds)`: Prometheus recording and alerting rules from the same targets, multi-window and
  multi-burn-rate (the SRE workbook's scheme, as Sloth and Pyrra generate it).
- `histogram_quantile`: Prometheus' interpolation over one histogram's buckets (the status page and the load-test
  check use it on the gateway's own histograms).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.config import BATCH_CLASS, GatewayConfig, PoolConfig
from policies.launch import AMD, NATIVE_CONTEXT
from policies.traffic import pool_class

METRICS = ("ttft", "tpot", "e2e")
METRIC_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "end to end"}
# The gateway's histogram of each target metric, and its label of the class (gateway/observability/metrics.py).
METRIC_SERIES = {
    "ttft": "m3gate_time_to_first_token_seconds",
    "tpot": "m3gate_time_per_output_token_seconds",
    "e2e": "m3gate_request_duration_seconds",
}
# The stages a request's latency splits into, each a gateway histogram labelled by class.
STAGE_SERIES = {
    "gateway queue": "m3gate_gateway_queue_seconds",
    "engine queue + prefill": "m3gate_prefill_seconds",
    "decode": "m3gate_decode_seconds",
}


# ---------------------------------------------------------------------------------------------------------------
# Histograms


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The q-quantile of a histogram, interpolated within its bucket as Prometheus' histogram_quantile does.
    `counts`: per bucket, not cumulative, one per bound then +Inf (a trailing sum, as gateway/observability/metrics.py
    keeps it, is ignored). None without observations; a quantile in the +Inf bucket is the last finite bound."""
    buckets = list(counts[: len(bounds) + 1])
    total = sum(buckets)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, n in enumerate(buckets):
        if seen + n >= rank and n > 0:
            if i >= len(bounds):
                return float(bounds[-1])
            lower = 0.0 if i == 0 else float(bounds[i - 1])
            upper = float(bounds[i])
            return lower + (upper - lower) * (rank - seen) / n
        seen += n
    return float(bounds[-1])


def quantile_of_samples(q: float, values: Sequence[float]) -> float | None:
    """Linear-interpolated sample quantile (numpy's default), for raw load-test measurements."""
    data = sorted(values)
    if not data:
        return None
    pos = q * (len(data) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def go_float(value: float) -> str:
    """A bucket bound as the `le` label spells it (Go's float formatting, as prometheus_client writes it)."""
    if value == math.inf:
        return "+Inf"
    text = repr(float(value))
    return text


# ---------------------------------------------------------------------------------------------------------------
# The contract


@dataclass(slots=True)
class Target:
    metric: str  # ttft | tpot | e2e
    percentile: str  # p50 | p95 | p99
    ms: float

    @property
    def q(self) -> float:
        return int(self.percentile[1:]) / 100.0


@dataclass(slots=True)
class PoolTerms:
    name: str
    max_model_len: int
    replicas: int
    replicas_source: str  # "launch.replicas", "endpoints", "discovery"
    kv_blocks: int | None  # per replica, when configured
    block_size: int
    precision: str
    kernel_path: str
    speculative: str

    @property
    def kv_tokens(self) -> int | None:
        return None if self.kv_blocks is None else self.kv_blocks * self.block_size * self.replicas


@dataclass(slots=True)
class ClassTerms:
    name: str
    priority: int
    pools: list[PoolTerms]
    targets: list[Target]
    max_concurrency: int
    queue_length: int
    max_queue_wait_s: float

    @property
    def context_ceiling(self) -> int:
        return max((p.max_model_len for p in self.pools), default=0)

    @property
    def replicas(self) -> int:
        return sum(p.replicas for p in self.pools)

    @property
    def kv_blocks(self) -> int | None:
        known = [p.kv_blocks * p.replicas for p in self.pools if p.kv_blocks is not None]
        return sum(known) if known and len(known) == len(self.pools) else None


@dataclass(slots=True)
class Contract:
    model: str
    classes: list[ClassTerms]
    verdicts: list[Verdict] = field(default_factory=list)
    source: str = ""  # what the verdicts were checked against


def _pool_terms(pool: PoolConfig) -> PoolTerms:
    spec = pool.launch
    if spec is not None:
        replicas, source = spec.replicas, "launch.replicas"
    elif pool.discovery is not None:
        replicas, source = len(pool.endpoints), "endpoints + DNS discovery (at least)"
    else:
        replicas, source = len(pool.endpoints), "endpoints"
    if spec is None:
        precision, kernel, spec_dec = "not declared (no launch)", "not declared", "not declared"
    else:
        kv = spec.kv_cache_dtype or ("fp8" if pool.max_model_len > NATIVE_CONTEXT or spec.high_concurrency else "auto")
        kv_text = "fp8 KV cache" if kv == "fp8" else "KV cache in the model dtype"
        quant = f", online {spec.online_quantization}" if spec.online_quantization else ""
        precision = f"{spec.variant} weights{quant}, {kv_text}"
        parallel = f"TP={spec.tensor_parallel_size}" + (f" DP={spec.data_parallel_size}" if spec.data_parallel_size > 1
                                                        else "") + (" EP" if spec.expert_parallel else "")
        if spec.hardware in AMD:
            attention = "TRITON_ATTN" + (", AITER MoE + page-16 sparse attention" if spec.high_concurrency else "")
        else:
            attention = "vLLM's default attention backend"
        kernel = f"{spec.hardware} ×{spec.gpus_per_replica}, {parallel}, {attention}"
        if spec.speculative_decoding:
            backend = spec.draft_attention_backend or ("vLLM's choice" if spec.hardware in AMD else "FLASH_ATTN")
            spec_dec = f"EAGLE3 ({spec.draft_head} draft head, 3 tokens, {backend})"
        else:
            spec_dec = "off"
    return PoolTerms(pool.name, pool.max_model_len, replicas, source, pool.kv_blocks, pool.block_size, precision,
                     kernel, spec_dec)


def build_contract(config: GatewayConfig) -> Contract:
    """Each class with the pools that serve it by default and the targets it must hold."""
    pools = config.pools_by_size()
    classes = []
    for name, cls in sorted(config.traffic.classes.items(), key=lambda kv: (kv[1].priority, kv[0])):
        if name == BATCH_CLASS:  # the Batch API's: bound by completion windows, not latency targets
            continue
        served = [_pool_terms(p) for p in pools if pool_class(config.traffic, pools, p.name) == name]
        targets = [Target(metric, pct, ms) for metric, items in cls.latency_targets().items() for pct, ms in items]
        classes.append(ClassTerms(name, cls.priority, served, targets, cls.max_concurrency, cls.queue_length,
                                  cls.max_queue_wait_s))
    return Contract(config.model, classes)


# ---------------------------------------------------------------------------------------------------------------
# Checking


@dataclass(slots=True)
class Verdict:
    cls: str
    metric: str
    percentile: str
    target_ms: float
    observed_ms: float | None
    samples: int
    dominant_stage: str | None = None  # for a failure: the stage with the largest P95
    stages_p95_ms: dict[str, float] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.observed_ms is None:
            return "NO DATA"
        return "PASS" if self.observed_ms <= self.target_ms else "FAIL"


@dataclass(slots=True)
class Observed:
    """What was measured for one class: per metric its quantiles in seconds and sample count; per stage its P95."""

    quantiles: dict[str, dict[str, float | None]] = field(default_factory=dict)  # metric → p50/p95/p99 → s
    samples: dict[str, int] = field(default_factory=dict)  # metric → count
    stages_p95_s: dict[str, float | None] = field(default_factory=dict)


def check(contract: Contract, observed: Mapping[str, Observed], source: str = "") -> Contract:
    """Fill `contract.verdicts`: one per class target."""
    verdicts = []
    for cls in contract.classes:
        obs = observed.get(cls.name) or Observed()
        stages = {k: round(v * 1000, 3) for k, v in obs.stages_p95_s.items() if v is not None}
        for t in cls.targets:
            value = (obs.quantiles.get(t.metric) or {}).get(t.percentile)
            v = Verdict(cls.name, t.metric, t.percentile, t.ms, None if value is None else round(value * 1000, 3),
                        obs.samples.get(t.metric, 0))
            if v.status == "FAIL":
                v.stages_p95_ms = stages
                relevant = {k: ms for k, ms in stages.items() if t.metric != "ttft" or k != "decode"}
                v.dominant_stage = max(relevant, key=lambda k: relevant[k]) if relevant else None
            verdicts.append(v)
    contract.verdicts = verdicts
    contract.source = source
    return contract


def passed(contract: Contract) -> bool:
    return all(v.status != "FAIL" for v in contract.verdicts)


def observed_from_samples(samples: Mapping[str, Mapping[str, Sequence[float]]],
                          stages_p95_s: Mapping[str, Mapping[str, float | None]] | None = None) -> dict[str, Observed]:
    """class → metric → raw values (seconds), e.g. from a load test → Observed per class."""
    out = {}
    for cls, metrics in samples.items():
        obs = Observed(stages_p95_s=dict((stages_p95_s or {}).get(cls, {})))
        for metric, values in metrics.items():
            obs.samples[metric] = len(values)
            obs.quantiles[metric] = {p: quantile_of_samples(int(p[1:]) / 100, values) for p in ("p50", "p95", "p99")}
        out[cls] = obs
    return out


# ---------------------------------------------------------------------------------------------------------------
# Rendering


def _fmt_int(n: int | None) -> str:
    return "—" if n is None else f"{n:,}"


def _fmt_tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n < 1024 * 1024 else (
        f"{n / (1024 * 1024):g}M" if n % (1024 * 1024) == 0 else f"{n:,}")


def _targets_text(cls: ClassTerms, metric: str) -> str:
    items = [f"{t.percentile.upper()} ≤ {t.ms:g} ms" for t in cls.targets if t.metric == metric]
    return ", ".join(items) or "—"


def to_markdown(contract: Contract) -> str:
    lines = [f"# Operating contract — {contract.model}", ""]
    lines += ["Generated by `m3gate contract` from the pool file: each traffic class, the pools that serve it, "
              "their capacity and numerics, and the latency it must hold.", ""]
    lines += ["| class | priority | context ceiling | warm capacity | TTFT | TPOT | end to end |",
              "|---|---|---|---|---|---|---|"]
    for c in contract.classes:
        kv = f", {_fmt_int(c.kv_blocks)} KV blocks" if c.kv_blocks is not None else ", KV blocks from /metrics"
        lines.append(f"| {c.name} | {c.priority} | {_fmt_tokens(c.context_ceiling) if c.pools else '—'} | "
                     f"{c.replicas} replica{'' if c.replicas == 1 else 's'}{kv} | {_targets_text(c, 'ttft')} | {_targets_text(c, 'tpot')} | "
                     f"{_targets_text(c, 'e2e')} |")
    lines.append("")
    for c in contract.classes:
        lines += [f"## {c.name}", ""]
        lines.append(f"Admission: {c.max_concurrency} in flight per pool, {c.queue_length} queued, "
                     f"{c.max_queue_wait_s:g} s longest wait.")
        lines.append("")
        if not c.pools:
            lines += ["No pool serves this class by default (it is reached by header or key only).", ""]
        else:
            lines += ["| pool | max_model_len | replicas | KV blocks / replica | precision | kernel path | "
                      "speculative decoding |", "|---|---|---|---|---|---|---|"]
            for p in c.pools:
                lines.append(f"| {p.name} | {p.max_model_len:,} | {p.replicas} ({p.replicas_source}) | "
                             f"{_fmt_int(p.kv_blocks)} | {p.precision} | {p.kernel_path} | {p.speculative} |")
            lines.append("")
    if contract.verdicts:
        ok = passed(contract)
        lines += [f"## Check — {'PASS' if ok else 'FAIL'}", "", f"Against: {contract.source}", "",
                  "| class | metric | percentile | target ms | observed ms | samples | verdict | dominant stage (P95) |",
                  "|---|---|---|---|---|---|---|---|"]
        for v in contract.verdicts:
            obs = "—" if v.observed_ms is None else f"{v.observed_ms:,.1f}"
            dom = "" if v.dominant_stage is None else f"{v.dominant_stage} ({v.stages_p95_ms[v.dominant_stage]:,.1f} ms)"
            lines.append(f"| {v.cls} | {METRIC_TITLES[v.metric]} | {v.percentile.upper()} | {v.target_ms:g} | {obs} | "
                         f"{v.samples} | **{v.status}** | {dom} |")
        lines.append("")
    return "\n".join(lines)


_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1d2330;max-width:1200px}
table{border-collapse:collapse;margin:8px 0 18px}td,th{border:1px solid #d5d9e0;padding:4px 8px;text-align:left;
vertical-align:top}th{background:#f1f3f7}.PASS{color:#0a7d38;font-weight:600}.FAIL{color:#c0261b;font-weight:600}
.NODATA{color:#888}h1{font-size:22px}h2{font-size:17px;margin-top:26px}.plots{display:flex;flex-wrap:wrap;gap:16px}
figure{margin:0;border:1px solid #e3e6eb;padding:8px}figcaption{font-size:12px;color:#555}"""


def _bar_svg(title: str, rows: Sequence[tuple[str, float | None, float | None]], unit: str = "ms") -> str:
    """Horizontal bars: (label, observed, target); observed red when above its target, the target a black tick."""
    width, label_w, row_h = 470, 150, 22
    top = max([v for _, v, _t in rows if v is not None] + [t for _, _v, t in rows if t is not None] + [1e-9]) * 1.1
    height = 24 + row_h * len(rows)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(title)}">',
             f'<text x="4" y="14" font-size="12" font-weight="600">{html.escape(title)}</text>']
    span = width - label_w - 60
    for i, (label, value, target) in enumerate(rows):
        y = 22 + i * row_h
        parts.append(f'<text x="4" y="{y + 14}" font-size="11">{html.escape(label)}</text>')
        if value is not None:
            w = span * value / top
            colour = "#c0261b" if target is not None and value > target else "#2f7ed8"
            parts.append(f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="14" fill="{colour}"/>')
            parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 14}" font-size="11">{value:,.1f} {unit}</text>')
        else:
            parts.append(f'<text x="{label_w}" y="{y + 14}" font-size="11" fill="#888">no data</text>')
        if target is not None:
            x = label_w + span * target / top
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 20}" stroke="#111" stroke-width="2"/>')
    parts.append("</svg>")
    return "".join(parts)


def plots(contract: Contract) -> list[tuple[str, str]]:
    """(caption, svg) per class: observed percentiles against targets; per failing class, its stages' P95."""
    out = []
    by_class: dict[str, list[Verdict]] = {}
    for v in contract.verdicts:
        by_class.setdefault(v.cls, []).append(v)
    for cls, verdicts in by_class.items():
        rows = [(f"{METRIC_TITLES[v.metric]} {v.percentile.upper()}", v.observed_ms, v.target_ms) for v in verdicts]
        out.append((f"{cls}: observed (bars) against targets (ticks)", _bar_svg(f"{cls} — latency", rows)))
        failing = [v for v in verdicts if v.status == "FAIL" and v.stages_p95_ms]
        if failing:
            stages = failing[0].stages_p95_ms
            out.append((f"{cls}: P95 of each stage (the failures' dominant stage is the longest)",
                        _bar_svg(f"{cls} — stage P95", [(k, ms, None) for k, ms in stages.items()])))
    return out


def to_html(contract: Contract) -> str:
    """A standalone page: the contract's tables and, when checked, the verdicts and their plots."""
    import re

    body = []
    for line in to_markdown(contract).splitlines():
        body.append(line)
    # A small Markdown subset (headings, tables, paragraphs, **bold**, `code`) is all to_markdown writes.
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>Operating contract — "
           f"{html.escape(contract.model)}</title><style>{_CSS}</style></head><body>"]
    table: list[list[str]] = []

    def inline(text: str) -> str:
        text = html.escape(text)
        text = re.sub(r"\*\*(PASS|FAIL|NO DATA)\*\*", lambda m: f"<span class='{m[1].replace(' ', '')}'>{m[1]}</span>",
                      text)
        text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
        return re.sub(r"`(.+?)`", r"<code>\1</code>", text)

    def flush() -> None:
        if table:
            head, rows = table[0], table[2:]
            out.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in head) + "</tr>")
            for row in rows:
                out.append("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in row) + "</tr>")
            out.append("</table>")
            table.clear()

    for line in body:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip("|").split("|")])
            continue
        flush()
        if line.startswith("## "):
            out.append(f"<h2>{inline(line[3:])}</h2>")
        elif line.startswith("# "):
            out.append(f"<h1>{inline(line[2:])}</h1>")
        elif line.strip():
            out.append(f"<p>{inline(line)}</p>")
    flush()
    figures = plots(contract)
    if figures:
        out.append("<h2>Plots</h2><div class='plots'>")
        for caption, svg in figures:
            out.append(f"<figure>{svg}<figcaption>{html.escape(caption)}</figcaption></figure>")
        out.append("</div>")
    out.append("</body></html>")
    return "\n".join(out)


def to_json(contract: Contract) -> dict[str, Any]:
    return {
        "model": contract.model,
        "classes": [{
            "class": c.name, "priority": c.priority, "context_ceiling": c.context_ceiling, "replicas": c.replicas,
            "kv_blocks": c.kv_blocks,
            "pools": [{"pool": p.name, "max_model_len": p.max_model_len, "replicas": p.replicas,
                       "kv_blocks_per_replica": p.kv_blocks, "precision": p.precision, "kernel_path": p.kernel_path,
                       "speculative_decoding": p.speculative} for p in c.pools],
            "targets": [{"metric": t.metric, "percentile": t.percentile, "ms": t.ms} for t in c.targets],
        } for c in contract.classes],
        "source": contract.source,
        "passed": passed(contract) if contract.verdicts else None,
        "verdicts": [{"class": v.cls, "metric": v.metric, "percentile": v.percentile, "target_ms": v.target_ms,
                      "observed_ms": v.observed_ms, "samples": v.samples, "status": v.status,
                      "dominant_stage": v.dominant_stage, "stages_p95_ms": v.stages_p95_ms}
                     for v in contract.verdicts],
    }


# ---------------------------------------------------------------------------------------------------------------
# SLO alert rules

# The SRE workbook's multi-window, multi-burn-rate alerts (as Sloth and Pyrra generate them), for a 30-day SLO
# period: (severity, long window, short window, burn rate). A window pair fires when both windows burn faster than
# the rate; the short window makes the alert stop soon after the burning does.
BURN_WINDOWS = (
    ("page", "1h", "5m", 14.4),   # 2% of the month's budget in an hour
    ("page", "6h", "30m", 6.0),   # 5% in six hours
    ("ticket", "1d", "2h", 3.0),  # 10% in a day
    ("ticket", "3d", "6h", 1.0),  # 10% in three days
)
SLO_PERIOD = "30d"


def sli_bound(target_s: float, bounds: Sequence[float]) -> float:
    """The histogram bound an SLI can count exactly: the largest bucket bound at or under the target (stricter
    than the target when it is not a bound), else the smallest bound."""
    under = [b for b in bounds if b <= target_s + 1e-12]
    return max(under) if under else min(bounds)


def slo_rules(config: GatewayConfig, bounds: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Prometheus rule groups for every class target: recording rules for the error ratio over each window
    (`m3gate:slo_errors:ratio_rate<window>`: the share of requests slower than the target), and alerts per window
    pair. A PXX target means XX% of requests within the target: its error budget is 1 - XX/100, and a window pair
    whose burn rate times the budget reaches 1 could never fire, so it is left out (P50 targets alert on the slow
    burns only). `bounds`: metric → the histogram's bucket bounds (the SLI counts the bucket `le` at or under the
    target)."""
    windows = sorted({w for _, long, short, _ in BURN_WINDOWS for w in (long, short)}, key=_window_seconds)
    recording: list[dict[str, Any]] = []
    alerts: list[dict[str, Any]] = []
    for cls_name, cls in sorted(config.traffic.classes.items()):
        if cls_name == BATCH_CLASS:
            continue
        for metric, items in cls.latency_targets().items():
            series = METRIC_SERIES[metric]
            for pct, ms in items:
                le = sli_bound(ms / 1000.0, bounds[metric])
                objective = int(pct[1:]) / 100.0
                budget = 1.0 - objective
                slo = f"{metric}_{pct}"
                labels = {"class": cls_name, "slo": slo}
                for window in windows:
                    selector = f'{{class="{cls_name}"}}'
                    expr = (f'1 - (sum(rate({series}_bucket{{class="{cls_name}",le="{go_float(le)}"}}[{window}])) '
                            f'/ sum(rate({series}_count{selector}[{window}])))')
                    recording.append({"record": f"m3gate:slo_errors:ratio_rate{window}", "expr": expr,
                                      "labels": dict(labels)})
                for severity, long, short, rate in BURN_WINDOWS:
                    if rate * budget >= 1.0:
                        continue
                    threshold = rate * budget
                    sel = f'{{class="{cls_name}",slo="{slo}"}}'
                    alerts.append({
                        "alert": f"M3gateSLOBurn_{cls_name}_{slo}_{long}".replace("-", "_").replace(".", "_"),
                        "expr": (f"m3gate:slo_errors:ratio_rate{long}{sel} > {threshold:.6g} "
                                 f"and m3gate:slo_errors:ratio_rate{short}{sel} > {threshold:.6g}"),
                        "labels": {"severity": severity, "class": cls_name, "slo": slo,
                                   "long_window": long, "short_window": short},
                        "annotations": {
                            "summary": f"{cls_name}: {METRIC_TITLES[metric]} {pct.upper()} ≤ {ms:g} ms is burning its "
                                       f"error budget {rate:g}× too fast",
                            "description": (f"More than {threshold:.2%} of {cls_name} requests took over "
                                            f"{le * 1000:g} ms ({METRIC_TITLES[metric]}) over the last {long} and "
                                            f"{short}; the objective allows {budget:.0%} over a {SLO_PERIOD} period. "
                                            + ("" if abs(le * 1000 - ms) < 1e-6 else
                                               f"The target {ms:g} ms is not a bucket bound; the SLI counts "
                                               f"le={go_float(le)} s, slightly stricter. ")
                                            + "`m3gate contract --prometheus URL` names the dominant stage."),
                        },
                    })
    return {"groups": [
        {"name": "m3gate-slo-recording", "interval": "30s", "rules": recording},
        {"name": "m3gate-slo-alerts", "rules": alerts},
    ]}


def _window_seconds(window: str) -> int:
    return int(window[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[window[-1]]
