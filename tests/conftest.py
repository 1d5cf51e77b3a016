"""Shared pytest wiring. Fixture modules live beside the tests that own them; they are registered here."""

pytest_plugins: list[str] = ["tests.vllm_fixtures"]
