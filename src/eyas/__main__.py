"""`python -m eyas ...` (torchrun needs a module entry point)."""

import sys

from eyas.cli import main

if __name__ == "__main__":
    sys.exit(main())
