"""``python -m benchmarks.time_to_accuracy``: runs :func:`benchmarks.time_to_accuracy.main.main`.

The code lives in importable modules: ranks on emulated hosts are fresh interpreters that
import their functions by name.
"""

import sys

from benchmarks.time_to_accuracy.main import main

if __name__ == "__main__":
    sys.exit(main())
