"""``python -m benchmarks.pipeline_memory``: runs :func:`benchmarks.pipeline_memory.main.main`.

The code lives in an importable module: spawned ranks import their function by name.
"""

import sys

from benchmarks.pipeline_memory.main import main

if __name__ == "__main__":
    sys.exit(main())
