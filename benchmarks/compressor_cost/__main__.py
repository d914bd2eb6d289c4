"""``python -m benchmarks.compressor_cost``: runs :func:`benchmarks.compressor_cost.main.main`.

The code lives in importable modules, not here: ranks started in fresh interpreters (spawned,
or on emulated hosts) import their functions by name.
"""

import sys

from benchmarks.compressor_cost.main import main

if __name__ == "__main__":
    sys.exit(main())
