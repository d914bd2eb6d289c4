"""``python -m benchmarks.planner``: runs :func:`benchmarks.planner.main.main`."""

import sys

from benchmarks.planner.main import main

if __name__ == "__main__":
    sys.exit(main())
