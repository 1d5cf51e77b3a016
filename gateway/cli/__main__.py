"""`python -m gateway.cli ...`: the same commands as the `m3gate` console script."""

import sys

from gateway.cli.commands import main

sys.exit(main())
