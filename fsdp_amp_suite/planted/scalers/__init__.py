"""The planted scalers: `ours` with a single clause of the contract broken, the kind of bug seen upstream.

Use one with `--scaler fsdp_amp_suite.planted.scalers:<name>` (the package binds every factory by its name) or its
module's spec, `fsdp_amp_suite.planted.scalers.<module>:<name>`. Each is declared by
`@mutant(name, caught_by=..., matrix=...)` (fsdp_amp_suite/planted/registry.py): tests/meta/test_mutants.py checks
that every test in its caught_by fails on it (and `ours` passes them), tests/meta/test_teeth.py that the matrix
roles fail matrix cells.
The catalog is split by the part of the contract each breaks:

    agreement.py    found_inf agreed across ranks, groups, mesh dims, optimizers
    checking.py     the unscale and the inf/NaN check
    schedule.py     growth, backoff, the tracker, the settings, the checkpoint
    calls.py        the call protocol: order, misuse, arguments, several and fused optimizers
    torch_state.py  torch's state and protocols beyond the public API (tests/conformance/test_torch_state.py)
    common.py       what they share
"""
from fsdp_amp_suite.planted.registry import REGISTERED_SCALERS
from fsdp_amp_suite.planted.scalers import agreement, calls, checking, schedule, torch_state  # noqa: F401  (they register)

globals().update({m.name: m.factory for m in REGISTERED_SCALERS})
