"""Programs some tests need on PATH (redis-server, haproxy, prometheus, chromium, ...), and what a missing one means.

A test declares them with `@pytest.mark.tools("redis-server", ...)`. Where one is missing the test is skipped when run
by hand, but FAILS under `make test` / `make test-fast` (they export M3GATE_REQUIRE_TOOLS=1, and install every tool
first) and in CI: a suite that silently skipped there would pass without having run.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "M3GATE_REQUIRE_TOOLS"
# The make target that installs each tool (each one is a prerequisite of `make test`).
INSTALLED_BY = {
    "redis-server": "make redis",
    "haproxy": "make haproxy",
    "prometheus": "make prometheus",
    "promtool": "make prometheus",
    "chromium": "make chromium",
    "chromedriver": "make chromium",
}


def tools_required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1" or bool(os.environ.get("CI"))


def missing(*tools: str) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]


def require_tools(*tools: str) -> None:
    """Skip the calling test where a tool is missing, or fail it where tools are required (see the module doc)."""
    absent = missing(*tools)
    if not absent:
        return
    how = ", ".join(sorted({INSTALLED_BY.get(t, f"install {t}") for t in absent}))
    message = f"{' and '.join(absent)} not on PATH ({how})"
    if tools_required():
        pytest.fail(f"{message}; {REQUIRE_ENV}=1 or CI is set, so a missing tool fails instead of skipping",
                    pytrace=False)
    pytest.skip(message)
