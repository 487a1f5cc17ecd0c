"""python -m tests.repro NAME [--scaler SPEC ...]: tests/repro/runner.py main."""
import sys

from tests.repro.runner import main

sys.exit(main())
