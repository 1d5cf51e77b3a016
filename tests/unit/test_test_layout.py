"""pytest imports a test module without a package (`__init__.py`) by its basename alone, so two such modules of one
name in different folders make collection fail for the whole run: each basename may appear once among them."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_test_modules_outside_packages_have_unique_basenames() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            seen[path.name].append(str(path.relative_to(TESTS)))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}
