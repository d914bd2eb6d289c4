"""``python -m benchmarks.gpu_check``: runs :func:`benchmarks.gpu_check.main.main`.

The code lives in importable modules, not here: ranks started in fresh interpreters import
their functions by name.
"""

import sys

from benchmarks.gpu_check.main import main

if __name__ == "__main__":
    sys.exit(main())
