"""Every planted defect of the suite, apart from the suites that must catch them.

`scalers/`: mutant scalers, by the part of the contract each breaks (`--scaler fsdp_amp_suite.planted.scalers:<name>`);
`wrappers.py`: broken FSDP wrappers
(`--fsdp fsdp_amp_suite.planted.wrappers:<name>`). Each is declared where it is written (`@mutant`, `@broken_wrapper`:
registry.py); the tables the meta-tests read are derived here from those declarations.
"""
from fsdp_amp_suite.planted import scalers, wrappers  # noqa: F401  (importing them registers their defects)
from fsdp_amp_suite.planted.registry import REGISTERED_SCALERS, REGISTERED_WRAPPERS

SCALERS = {m.name: m for m in REGISTERED_SCALERS}  # mutant name -> Mutant
WRAPPERS = {w.name: w for w in REGISTERED_WRAPPERS}  # broken wrapper name -> BrokenWrapper

# mutant name -> the test functions that must fail on it (tests/meta/test_mutants.py, test_tables.py)
EXPECTED = {name: list(m.caught_by) for name, m in SCALERS.items() if m.caught_by}


def matrix_mutants(role: str) -> list[str]:
    """The mutants the matrix teeth must see fail (tests/meta/test_teeth.py): a role of registry.ROLES."""
    return [name for name, m in SCALERS.items() if m.matrix == role]


def broken_wrappers(role: str) -> list[str]:
    """The broken wrappers whose cells of that slice must fail (tests/meta/test_teeth.py)."""
    return [name for name, w in WRAPPERS.items() if w.matrix == role]
