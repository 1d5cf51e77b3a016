"""One results format for every benchmark: `results.json` in the run's folder, which `make bench` and the docs'
tables read without knowing the benchmark.

    {"schema": "m3gate-bench/1", "name": "overhead", "command": "python -m loadtests.bench.overhead --quick",
     "parameters": {"quick": true, ...}, "reference": "the same requests sent to the replicas directly",
     "figures": [{"name": "added latency p50 at c=32", "value": 0.41, "unit": "ms", "reference": "direct",
                  "reference_value": 1.2, "goal": "≤ 1", "passed": true}, ...],
     "passed": true}

A figure without a goal is informational (`passed` null). The run passes when no figure with a goal failed; it is
null when none has a goal. A benchmark builds a `Results`, adds its figures and writes it; `read` and `table` are
the other side.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SCHEMA = "m3gate-bench/1"
FILE = "results.json"


class Results:
    """The figures of one benchmark run, written as `results.json`."""

    def __init__(self, name: str, parameters: Mapping[str, Any], reference: str = "") -> None:
        self.name = name
        self.parameters = {k: _jsonable(v) for k, v in parameters.items()}
        self.reference = reference
        self.figures: list[dict[str, Any]] = []

    def add(self, name: str, value: float | None, unit: str, *, at_most: float | None = None,
            at_least: float | None = None, goal: str | None = None, passed: bool | None = None,
            reference: str | None = None, reference_value: float | None = None) -> dict[str, Any]:
        """One figure. `at_most` / `at_least` state the goal and decide pass/fail (a missing value fails); else a
        `goal` text with its own `passed`, or neither (informational)."""
        if at_most is not None or at_least is not None:
            bound = at_most if at_most is not None else at_least
            goal = goal or f"{'≤' if at_most is not None else '≥'} {_value(bound, unit)}"
            passed = _finite(value) and (value <= at_most if at_most is not None else value >= at_least)
        figure = {"name": name, "value": value if _finite(value) else None, "unit": unit, "reference": reference,
                  "reference_value": reference_value, "goal": goal, "passed": passed}
        self.figures.append(figure)
        return figure

    @property
    def passed(self) -> bool | None:
        verdicts = [f["passed"] for f in self.figures if f["passed"] is not None]
        return all(verdicts) if verdicts else None

    def as_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "name": self.name, "command": _command(), "parameters": self.parameters,
                "reference": self.reference, "figures": self.figures,
                "passed": self.passed}

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / FILE
        path.write_text(json.dumps(self.as_dict(), indent=2, ensure_ascii=False) + "\n")
        return path


def read(path: Path) -> dict[str, Any]:
    """A results.json, checked for the schema (a ValueError names what is wrong)."""
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    for key in ("name", "parameters", "figures"):
        if key not in data:
            raise ValueError(f"{path}: no {key!r}")
    return data


def find(folder: Path) -> list[dict[str, Any]]:
    """Every results.json under `folder`, in path order."""
    return [read(p) for p in sorted(folder.rglob(FILE))]


def table(runs: Iterable[Mapping[str, Any]]) -> str:
    """One markdown table of every figure of every run: bench, figure, value, reference, goal, verdict."""
    lines = ["| bench | figure | value | reference | goal | |", "|---|---|---|---|---|---|"]
    for run in runs:
        for f in run["figures"]:
            ref = f["reference"] or ""
            if f.get("reference_value") is not None:
                ref = f"{ref} {_value(f['reference_value'], f['unit'])}".strip()
            verdict = {True: "PASS", False: "FAIL", None: ""}[f["passed"]]
            cells = (run["name"], f["name"], _value(f["value"], f["unit"]), ref, f["goal"] or "", verdict)
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def _command() -> str:
    """The command line that ran this, as `python -m MODULE ARGS` when a module of this checkout ran."""
    argv = list(sys.argv)
    root = Path(__file__).resolve().parents[2]
    script = Path(argv[0]).resolve() if argv and argv[0] else None
    if script is not None and script.suffix == ".py" and script.is_relative_to(root):
        module = ".".join(script.relative_to(root).with_suffix("").parts).removesuffix(".__main__")
        return shlex.join(["python", "-m", module, *argv[1:]])
    return shlex.join(argv)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: float | None) -> str:
    if not _finite(value):
        return "–"
    assert value is not None
    size = abs(value)
    return f"{value:,.0f}" if size >= 100 else f"{value:.3g}"


def _value(value: float | None, unit: str) -> str:
    text = _number(value)
    return text if text == "–" or not unit else f"{text}{unit}" if unit in ("%", "×") else f"{text} {unit}"


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except TypeError:
        return str(value)
    return value
