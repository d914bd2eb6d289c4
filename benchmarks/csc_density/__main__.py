"""``python -m benchmarks.csc_density``: runs :func:`benchmarks.csc_density.main.main`."""

import sys

from benchmarks.csc_density.main import main

if __name__ == "__main__":
    sys.exit(main())
