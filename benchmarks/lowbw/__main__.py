"""``python -m benchmarks.lowbw``: runs :func:`benchmarks.lowbw.main.main`.

The code lives in importable modules, not here: ranks started in fresh interpreters (spawned,
or on emulated hosts) import their functions by name.
"""

import sys

from benchmarks.lowbw.main import main

if __name__ == "__main__":
    sys.exit(main())
