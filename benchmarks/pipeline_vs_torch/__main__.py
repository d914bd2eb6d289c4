"""``python -m benchmarks.pipeline_vs_torch``: runs :func:`benchmarks.pipeline_vs_torch.main.main`.

The code lives in importable modules, not here: ranks started in fresh interpreters (spawned,
or on emulated hosts) import their functions by name.
"""

import sys

from benchmarks.pipeline_vs_torch.main import main

if __name__ == "__main__":
    sys.exit(main())
