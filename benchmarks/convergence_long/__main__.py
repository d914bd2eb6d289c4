import sys

from benchmarks.convergence_long.main import main

sys.exit(main())
