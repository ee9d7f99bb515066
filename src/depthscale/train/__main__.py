"""`python -m depthscale.train -c CONFIG [--section.key VALUE ...]` (what torchrun workers run)."""

import sys

from depthscale.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
