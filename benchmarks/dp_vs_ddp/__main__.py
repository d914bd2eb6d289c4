"""``python -m benchmarks.dp_vs_ddp``: runs :func:`benchmarks.dp_vs_ddp.main.main`.

The code lives in importable modules, not here: ranks started in fresh interpreters (spawned,
or on emulated hosts) import their functions by name.
"""

import sys

from benchmarks.dp_vs_ddp.main import main

if __name__ == "__main__":
    sys.exit(main())
