"""`python -m benchmarks SUITE [ARGS...]`, from the repository root: the same as `python benchmarks/run.py`."""

import sys

from benchmarks.run import main

sys.exit(main())
