"""Render the Grafana dashboard's panels as PNGs from a short simulated run, so a reviewer sees what ops will see.

`python -m loadtests.assets.render_dashboards [--seconds 20] [--out loadtests/results/dashboards]` starts the stack of
loadtests/lib/observability_stack.py (simulated pools with injected faults, one gateway, a real Prometheus at 1 s),
drives its load, then evaluates every target of every panel of deploy/grafana/m3gate.json over the run (variables on
"All") and draws one PNG per dashboard row, panels laid out two per line as in Grafana, plus an index.md.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from loadtests.lib.observability_stack import (  # noqa: E402
    PanelQuery,
    Prometheus,
    concrete,
    dashboard_queries,
    observability_stack,
    run_load,
    wait_for_scrapes,
)

RESULTS = Path(__file__).resolve().parents[1] / "results" / "dashboards"


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' value; URLs shortened to host:port."""
    def value(match: re.Match[str]) -> str:
        v = labels.get(match.group(1).strip(), "")
        return v.removeprefix("http://").removeprefix("https://")
    return re.sub(r"\{\{\s*([^}]+?)\s*\}\}", value, template) or str(labels)


def formatter(unit: str) -> FuncFormatter:
    def fmt(v: float, _pos: Any) -> str:
        if unit == "s":
            return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.1f} s"
        if unit == "percentunit":
            return f"{v * 100:.0f}%"
        if unit == "reqps":
            return f"{v:.1f}/s"
        return f"{v:.3g}"
    return FuncFormatter(fmt)


def draw_row(prometheus: Prometheus, row: str, queries: Sequence[PanelQuery], start: float, end: float,
             path: Path) -> int:
    """One figure per dashboard row; returns how many series were drawn."""
    panels = [(title, list(qs)) for title, qs in groupby(queries, key=lambda q: q.panel)]
    lines = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(lines, 2, figsize=(16, 4.6 * lines), squeeze=False)
    fig.suptitle(row, fontsize=15, fontweight="bold", x=0.01, ha="left")
    drawn = 0
    for ax, (title, qs) in zip(axes.flat, panels, strict=False):
        ax.set_title(title, fontsize=11, loc="left")
        for q in qs:
            for series in prometheus.query_range(concrete(q.expr), start, end):
                points = [(float(t) - start, float(v)) for t, v in series["values"] if math.isfinite(float(v))]
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, linewidth=1.4, label=legend(q.legend, series["metric"]))
                drawn += 1
        ax.yaxis.set_major_formatter(formatter(qs[0].unit))
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", ncol=2, framealpha=0.8)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="grey")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def render(seconds: float, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    queries = dashboard_queries()
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="m3gate-dashboards-") as tmp, observability_stack(Path(tmp)) as stack:
        start = time.time()
        outcomes = run_load(stack.gateway.url, seconds)
        wait_for_scrapes(stack.prometheus)
        end = time.time()
        index = [f"# m3gate dashboard, rendered from a {seconds:.0f} s simulated run", "",
                 "Load outcomes: " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())), ""]
        for n, (row, qs) in enumerate(groupby(queries, key=lambda q: q.row), start=1):
            path = out / f"{n:02d}-{slug(row)}.png"
            series = draw_row(stack.prometheus, row, list(qs), start, end, path)
            written.append(path)
            index.append(f"- [{row}]({path.name}): {series} series")
            print(f"{path} ({series} series)")
        (out / "index.md").write_text("\n".join(index) + "\n")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="load duration (default 20)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"output folder (default {RESULTS})")
    args = parser.parse_args(argv)
    render(args.seconds, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
