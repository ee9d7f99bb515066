"""`python -m depthscale ...`: the `depthscale` command without its console script, as launchers
in the `python -m torch.distributed.run` style and environments without the script on PATH run it."""

import sys

from depthscale.cli import main

if __name__ == "__main__":
    sys.exit(main())
