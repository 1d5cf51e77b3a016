"""What every client check script shares: its arguments, running each scenario on its own, and the JSON it prints.

The scripts run in the client's own virtualenv (scripts/install-clients.sh), never in the gateway's: they import only
the client library and the standard library. Each scenario's observations (or its error) go into one JSON object on
stdout, which tests/clients/test_client_matrix.py asserts on.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

MODEL = "MiniMaxAI/MiniMax-M3"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                  "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": WEATHER_SCHEMA}}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def thinking(on: bool) -> dict[str, Any]:
    """The extra body that turns MiniMax-M3's reasoning on or off (vLLM's chat template kwargs)."""
    return {"chat_template_kwargs": {"thinking_mode": "enabled" if on else "disabled"}}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", required=True, help="the gateway's OpenAI base URL, ending in /v1")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--only", action="append", default=[], help="run only these scenarios")
    return parser.parse_args()


def run_all(scenarios: dict[str, Callable[[argparse.Namespace], dict[str, Any]]], versions: dict[str, str]) -> None:
    """Run each scenario, catching its failure so one broken case still reports the others; print the JSON."""
    args = arguments()
    out: dict[str, Any] = {"versions": versions, "scenarios": {}}
    for name, scenario in scenarios.items():
        if args.only and name not in args.only:
            continue
        try:
            out["scenarios"][name] = scenario(args)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON, asserted on by the test
            out["scenarios"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()[-3000:]}
    json.dump(out, sys.stdout, default=str)
    sys.stdout.write("\n")
