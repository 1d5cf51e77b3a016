"""Shared pytest wiring. Fixture modules live beside the tests that own them; they are registered here."""

from __future__ import annotations

import pytest

from tests.support.tools import require_tools

pytest_plugins: list[str] = ["tests.vllm_fixtures"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """`@pytest.mark.tools(...)`: skip, or fail under `make test`, where a program the test runs is missing."""
    for marker in item.iter_markers("tools"):
        require_tools(*marker.args)
