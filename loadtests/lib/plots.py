"""PNG plots of a run (matplotlib, Agg backend): latency CDFs per class, TTFT over time, per-replica load."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.lib.client import RunOutput


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(run: RunOutput, report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    import numpy as np

    from loadtests.lib.client import tpot_of

    plt = _plt()
    written: list[Path] = []
    ok = [r for r in run.results if r.ok]
    classes = sorted({r.cls for r in run.results})

    # 1. latency CDFs per class
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (title, get) in zip(axes, (
            ("TTFT", lambda rs: [r.ttft for r in rs if r.ttft is not None]),
            ("TPOT", lambda rs: [t for t in (tpot_of(r) for r in rs) if t is not None]),
            ("ITL", lambda rs: [x for r in rs for x in r.itl]),
            ("E2E latency", lambda rs: [r.e2el for r in rs if r.e2el is not None]))):
        for cls in classes:
            vals = np.sort(np.asarray(get([r for r in ok if r.cls == cls]), dtype=float) * 1000)
            if vals.size:
                ax.plot(vals, np.arange(1, vals.size + 1) / vals.size, label=f"{cls} (n={vals.size})")
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        positive = [v for line in ax.get_lines() for v in line.get_xdata() if v > 0]
        if positive and max(positive) / min(positive) > 50:
            ax.set_xscale("log")  # wide ranges (a saturated run): log, zero-length gaps drop off the left edge
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        for q in (0.5, 0.95, 0.99):
            ax.axhline(q, color="grey", lw=0.5, ls=":")
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{report['workload']} — {report['target']}")
    fig.tight_layout()
    p = out_dir / "latency_cdf.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    written.append(p)

    # 2. TTFT over time, per class, with errors marked
    fig, ax = plt.subplots(figsize=(12, 4.2))
    for cls in classes:
        rs = [r for r in ok if r.cls == cls and r.ttft is not None]
        ax.scatter([r.t_send for r in rs], [r.ttft * 1000 for r in rs], s=6, alpha=0.6, label=cls)
    bad = [r for r in run.results if not r.ok]
    if bad:
        ax.scatter([r.t_send for r in bad], [max(1.0, (r.e2el or 0) * 1000) for r in bad], marker="x", color="red",
                   s=14, label=f"errors ({len(bad)})")
    ax.set_yscale("log")
    ax.set_xlabel("send time (s from start)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, markerscale=2)
    fig.tight_layout()
    p = out_dir / "ttft_over_time.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    written.append(p)

    # 3. per-replica load: requests and prompt tokens, plus in-flight requests over time
    per = report["routing"]["per_replica"]
    if per:
        names = list(per)
        short = [n.rsplit("//", 1)[-1] for n in names]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
        axes[0].bar(short, [per[n]["requests"] for n in names], color="tab:blue")
        axes[0].set_title("requests per replica")
        axes[1].bar(short, [per[n]["prompt_tokens"] for n in names], color="tab:orange")
        axes[1].set_title("prompt tokens per replica")
        for ax in axes[:2]:
            ax.tick_params(axis="x", rotation=30, labelsize=7)
        _in_flight(axes[2], run, names, short)
        fig.tight_layout()
        p = out_dir / "replica_load.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        written.append(p)
    return written


def _in_flight(ax: Any, run: RunOutput, names: Sequence[str], short: Sequence[str]) -> None:
    import numpy as np

    end = max((r.t_send + (r.e2el or 0) for r in run.results), default=1.0)
    grid = np.linspace(0, end, 300)
    for name, label in zip(names, short):
        starts = np.sort([r.t_send for r in run.results if r.replica == name])
        ends = np.sort([r.t_send + (r.e2el or 0) for r in run.results if r.replica == name])
        ax.plot(grid, np.searchsorted(starts, grid) - np.searchsorted(ends, grid), label=label, lw=1)
    ax.set_title("requests in flight per replica")
    ax.set_xlabel("s from start")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
