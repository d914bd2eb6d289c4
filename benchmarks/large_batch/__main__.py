"""``python -m benchmarks.large_batch``: runs :func:`benchmarks.large_batch.main.main`.

The code lives in an importable module: spawned ranks import their function by name.
"""

import sys

from benchmarks.large_batch.main import main

if __name__ == "__main__":
    sys.exit(main())
