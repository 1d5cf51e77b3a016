"""The request path's busiest modules stay readable in an afternoon: no function in them is longer than a screen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 60
# Files, or packages (every module in them). Paths that do not exist are not checked: a module being split into a
# package is checked under whichever name it has.
CHECKED = (
    "gateway/coordinator.py",
    "gateway/disagg.py",
    "gateway/telemetry.py",
    "policies/launch.py",
    "pools/kv_events",
)


def _modules() -> list[Path]:
    found: list[Path] = []
    for name in CHECKED:
        path = ROOT / name
        if path.is_dir():
            found.extend(sorted(path.rglob("*.py")))
        elif path.is_file():
            found.append(path)
    return found


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method longer than `limit` lines, `def` line to last line."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > limit]


@pytest.mark.parametrize("module", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_is_longer_than_a_screen(module: Path) -> None:
    assert long_functions(module.read_text()) == []


def test_the_check_sees_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def short():\n    pass\n\nasync def long():\n{body}\n") == [("long", MAX_LINES + 1)]
    assert len(_modules()) >= 3  # the gateway's three are always there
