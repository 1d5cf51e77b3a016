"""The gateway stays readable in an afternoon: no function in gateway/, policies/ or pools/ is longer than a screen.

The few that are longer are listed here by path and qualified name, each a debt to split: an entry whose file or
function is gone, or whose function is no longer long, fails too, so the list only shrinks."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 60
CHECKED = ("gateway", "policies", "pools")
# (path, qualified name): the long functions there are, none to be added.
ALLOWED = frozenset({
    ("gateway/observability/metrics.py", "RequestMetrics.__init__"),  # one line per metric family
    ("gateway/observability/metrics.py", "RequestMetrics.observe"),
    ("gateway/observability/metrics.py", "ReplicaCollector.collect"),
    ("pools/shared_state.py", "RedisState.__init__"),
    ("pools/sim/cli.py", "add_arguments"),  # one call per flag
    ("pools/sim/engine.py", "Engine._schedule"),
    ("pools/sim/metrics.py", "SimMetrics.__init__"),  # one line per metric family
    ("pools/sim/shapes.py", "ResponsesShape.events"),
    ("pools/sim/tokenizer.py", "normalize_messages"),
})


def _modules() -> list[Path]:
    return sorted(path for name in CHECKED for path in (ROOT / name).rglob("*.py"))


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, lines) of every function and method under `node`, `def` line to last line; a nested
    function is named after the function or class that holds it (`Outer.method.inner`)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert child.end_lineno is not None
            yield prefix + child.name, child.end_lineno - child.lineno + 1
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function or method longer than `limit` lines."""
    return [(name, lines) for name, lines in _functions(ast.parse(source)) if lines > limit]


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("module", _modules(), ids=_relative)
def test_no_function_is_longer_than_a_screen(module: Path) -> None:
    path = _relative(module)
    found = [(name, lines) for name, lines in long_functions(module.read_text()) if (path, name) not in ALLOWED]
    assert found == [], f"split these (at most {MAX_LINES} lines each)"


@pytest.mark.parametrize("entry", sorted(ALLOWED), ids="::".join)
def test_each_allowed_function_is_still_there_and_still_long(entry: tuple[str, str]) -> None:
    """A listed function that was split, renamed or removed leaves the list with it."""
    path, name = entry
    assert (ROOT / path).is_file(), f"{path} no longer exists: remove its entry from ALLOWED"
    lengths = dict(_functions(ast.parse((ROOT / path).read_text())))
    assert name in lengths, f"{path} has no function {name}: remove its entry from ALLOWED"
    assert lengths[name] > MAX_LINES, f"{path}::{name} is {lengths[name]} lines now: remove its entry from ALLOWED"


def test_the_check_sees_a_long_function_by_its_qualified_name() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    source = f"def short():\n    pass\n\nclass Outer:\n    async def long(self):\n{body}\n"
    assert long_functions(source) == [("Outer.long", MAX_LINES + 1)]
    assert len(_modules()) > 100  # every module of the three packages, sim and kv_events included
