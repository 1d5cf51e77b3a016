"""The commands (`m3gate ...`, or `python -m gateway.cli ...`): the argument parser and its commands (commands.py),
the demo with its workload (demo.py, demo_workload.py), `m3gate contract`'s files (contract.py), and the launcher
that tests and loadtests start gateway processes with (launcher.py)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The `m3gate` console script. The parser is imported when called, so that importing the launcher alone does
    not load the whole gateway."""
    from gateway.cli.commands import main as run

    return run(argv)
