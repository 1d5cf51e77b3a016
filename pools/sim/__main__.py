"""`python -m pools.sim ...`: the same as `m3gate sim ...` without the gateway's CLI imports."""

import argparse
import sys

from pools.sim.cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pools.sim", description="A vLLM-faithful simulated replica.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
