"""`python -m recycle_cli ARGS` = `recycle ARGS`."""

import sys

from recycle_cli import main

if __name__ == "__main__":
    sys.exit(main())
