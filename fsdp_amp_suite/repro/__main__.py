"""python -m fsdp_amp_suite.repro NAME [--scaler SPEC ...]: fsdp_amp_suite/repro/runner.py main."""
import sys

from fsdp_amp_suite.repro.runner import main

sys.exit(main())
