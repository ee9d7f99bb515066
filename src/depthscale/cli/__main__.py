"""`python -m depthscale.cli ...`: the `depthscale` command without the console script (what the
tests and drills run)."""

import sys

from depthscale.cli import main

if __name__ == "__main__":
    sys.exit(main())
