"""``python -m benchmarks.planner_papers``: runs :func:`benchmarks.planner_papers.main.main`."""

import sys

from benchmarks.planner_papers.main import main

if __name__ == "__main__":
    sys.exit(main())
