"""``python -m benchmarks.pipeline_replicas``: runs :func:`benchmarks.pipeline_replicas.main.main`.

The code lives in an importable module: the ranks, started in fresh interpreters inside the
emulated hosts, import their function by name.
"""

import sys

from benchmarks.pipeline_replicas.main import main

if __name__ == "__main__":
    sys.exit(main())
