"""``python -m benchmarks.hierarchical``: runs :func:`benchmarks.hierarchical.main.main`.

The code lives in an importable module: the ranks, started in fresh interpreters inside the
emulated hosts, import their function by name.
"""

import sys

from benchmarks.hierarchical.main import main

if __name__ == "__main__":
    sys.exit(main())
