"""The layering in pyproject.toml ([tool.importlinter]) holds, and the check would notice if it stopped holding."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("loadtests", "gateway", "pools", "policies")


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; "
         "sys.exit(c(['--no-cache']))"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120,
    )


def _copy_tree(dest: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_every_layering_contract_is_kept() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in result.stdout


def test_an_upward_import_breaks_the_check(tmp_path: Path) -> None:
    tree = _copy_tree(tmp_path)
    config = tree / "policies" / "config.py"
    config.write_text(config.read_text() + "\nfrom pools.replicas import Replica  # noqa: E402\n")
    result = _lint_imports(tree)
    assert result.returncode != 0
    assert "policies.config -> pools.replicas" in result.stdout


def test_a_cycle_hidden_behind_type_checking_breaks_the_check(tmp_path: Path) -> None:
    tree = _copy_tree(tmp_path)
    record = tree / "gateway" / "record.py"
    record.write_text(record.read_text() + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from gateway.coordinator import Coordinator  # noqa: F401\n")
    result = _lint_imports(tree)
    assert result.returncode != 0
    assert "gateway.record -> gateway.coordinator" in result.stdout
